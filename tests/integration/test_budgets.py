"""Spend limits: a run parks before a step would start past its budget, however many
workers race, and goes on when a person raises the budget."""

from __future__ import annotations

import pytest

from fleet import BadInput, Fleet
from tests.e2e.test_cli import fleet_cli
from tests.harness import Backend, Cluster, poll, starts


def test_the_run_parks_before_the_step_that_would_pass_its_budget(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    cluster.sweeper()
    # work#k records 10 + (k - 1) tokens: three steps spend 33, the budget.
    run = client.enqueue("chain", 6, budget={"tokens": 33})
    poll(lambda: run.status() == "needs_decision", 60, "the run to park on its budget")
    assert starts(backend, run.id) == {"work#1": 1, "work#2": 1, "work#3": 1}
    assert run.usage()["tokens"] == 33
    status = fleet_cli(backend, "status", run.id)
    assert "budget reached" in status.stdout and "--raise-budget" in status.stdout
    with pytest.raises(BadInput, match="not an effect in doubt"):
        client.resolve(run.id, "work#4", retry=True)

    raised = fleet_cli(backend, "resolve", run.id, "--raise-budget", "tokens=1000")
    assert raised.returncode == 0, raised.stderr
    assert run.wait(timeout=60) == sum(i * i for i in range(6))
    assert all(n == 1 for n in starts(backend, run.id).values())
    again = fleet_cli(backend, "resolve", run.id, "--raise-budget", "tokens=2000")
    assert again.returncode == 2 and "not waiting on its budget" in again.stderr


def test_racing_workers_start_no_step_once_the_budget_is_reached(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", concurrency=3)
    cluster.worker("w2", concurrency=3)
    cluster.sweeper()
    run = client.enqueue("spender", 24, budget={"tokens": 30})
    poll(lambda: run.status() == "needs_decision", 60, "the run to park on its budget")
    started = len(client.runtime.queries.attempts(run.id))
    assert started < 24, "the budget stopped the fan-out"
    # The workers are alive and busy with other runs; the parked run starts nothing more.
    others = [client.enqueue("chain", 3) for _ in range(3)]
    assert [o.wait(timeout=60) for o in others] == [5, 5, 5]
    assert len(client.runtime.queries.attempts(run.id)) == started
    assert run.status() == "needs_decision"
    cancelled = fleet_cli(backend, "cancel", run.id)
    assert cancelled.returncode == 0


def test_a_workflow_default_budget_and_bad_budgets(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("thrifty")
    poll(lambda: run.status() == "needs_decision", 60, "the default budget to park the run")
    assert starts(backend, run.id) == {"spend#1": 1}
    client.raise_budget(run.id, cost=1.0)
    assert run.wait(timeout=60) == 3
    for bad in ({"tokens": -1}, {"dollars": 5}, {}, {"cost": "lots"}):
        with pytest.raises(BadInput, match="budget"):
            client.enqueue("chain", 1, budget=bad)
