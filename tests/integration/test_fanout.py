"""Fan-outs settle before they raise (issue 16, DESIGN invariant 11): ``wf.map`` and
``wf.parallel`` report a dead branch only once every branch is done or dead, naming
every dead one; a run that ends revokes the leases of steps still running; a fan-out
or a run past its limit fails with one line. Both stores; real workers where timing
matters."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleet import Fleet, RunFailed
from fleet.config import Settings
from fleet.errors import BadInput
from fleet.states import RunStatus, StepKind, StepStatus
from fleet.store.ledger import Lease, NewStep
from fleet.testing import InlineBroker
from fleet.worker.attempt import execute
from fleet.worker.replay import advance
from tests import flows
from tests.harness import Backend, Cluster, executions, starts

FIVE = [f"branch#{i}" for i in range(1, 6)]
TOOLS = [f"tool-{i}" for i in range(5)]


@pytest.mark.parametrize("how", ["map", "parallel"])
def test_a_failing_branch_waits_for_every_sibling_before_the_workflow_sees_it(
    backend: Backend, client: Fleet, cluster: Cluster, how: str
) -> None:
    """The case that orphaned siblings: two workers, five 1-second branches, the third
    non-retryable and quick. The workflow catches the failure and returns; before the
    fix it returned at once and the siblings still pending never ran."""
    cluster.worker("w1", concurrency=2)
    cluster.worker("w2", concurrency=2)
    run = client.enqueue("settling", how, 5, 1.0, [2])
    ids = FIVE if how == "map" else TOOLS
    result = run.wait(timeout=60)
    assert result["dead"] == [ids[2]], result
    assert starts(backend, run.id) == {i: 1 for i in ids}, "every branch ran exactly once"
    ended = {e["step"] for e in executions(backend, run.id) if e["event"] == "end"}
    assert ended == set(ids) - {ids[2]}
    queries = client.runtime.queries
    finished_at = queries.run(run.id).finished_at
    for step_id in ids:
        step = queries.step(run.id, step_id)
        assert step is not None
        assert step.status == ("dead" if step_id == ids[2] else "done"), step
        assert step.finished_at is not None and step.finished_at <= finished_at, (
            f"{step_id} settled after its run ended"
        )


@pytest.mark.parametrize("how", ["map", "parallel"])
def test_every_dead_branch_is_named_the_first_as_the_cause(
    client: Fleet, inline: InlineBroker, how: str
) -> None:
    run = client.enqueue("settling", how, 5, 0.0, [1, 3])
    inline.drain()
    result = run.wait(timeout=5)
    ids = FIVE if how == "map" else TOOLS
    assert result["dead"] == [ids[1], ids[3]]
    assert result["failed"].startswith(f"2 branches failed ({ids[1]}, {ids[3]}); the first: step")


def test_a_replay_meeting_a_dead_branch_beside_pending_ones_parks_again(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    """Whatever wakes a run while a fan-out of it is unsettled (a signal, a timer, the
    sweeper re-sending a lost advance) replays it over a dead branch beside pending
    ones: the fan-out parks again and raises once every branch has settled (fails if
    it raises at the first dead branch it meets: the run ends, two branches never run)."""
    run = client.enqueue("settling", "map", 3, 0.0, [0])
    inline.step()  # the first advance records the three branches
    execute(client.runtime, run.id, "branch#1")  # the bad one: dead at its one attempt
    step = client.runtime.queries.step(run.id, "branch#1")
    assert step is not None and step.status == StepStatus.DEAD
    advance(client.runtime, run.id)  # a replay for another reason
    assert run.status() == "running", "the fan-out raised with branches still pending"
    inline.drain()
    assert run.wait(timeout=5)["dead"] == ["branch#1"]
    assert starts(backend, run.id) == {f"branch#{i}": 1 for i in (1, 2, 3)}


def test_parallel_runs_different_steps_and_returns_their_results_in_order(
    client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("settling", "parallel", 4, 0.0, [])
    inline.drain()
    assert run.wait(timeout=5) == {"ok": [0, "#1", 2, "#3"]}
    assert [(s.id, s.name) for s in run.steps()] == [
        ("tool-0", "branch"),
        ("tool-1", "other_branch"),
        ("tool-2", "branch"),
        ("tool-3", "other_branch"),
    ]


def test_parallel_with_return_exceptions_keeps_dead_branches_in_place(
    client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("settling", "parallel", 4, 0.0, [1, 2], True)
    inline.drain()
    assert run.wait(timeout=5) == {"ok": [0, "dead tool-1", "dead tool-2", "#3"]}


def limited(backend: Backend, **limits: int) -> tuple[Fleet, InlineBroker]:
    """A client whose settings have these limits (the ``client`` fixture made the schema)."""
    small = flows.fleet.with_settings(replace(backend.settings(), **limits))
    return small, InlineBroker(small)


def test_a_fan_out_over_fleet_max_fanout_fails_the_run_with_one_line(
    backend: Backend, client: Fleet
) -> None:
    small, inline = limited(backend, max_fanout=3)
    run = small.enqueue("settling", "map", 4, 0.0, [])
    inline.drain()
    with pytest.raises(RunFailed) as failed:
        run.wait(timeout=5)
    error = failed.value.error or ""
    assert error == (
        f"LimitExceeded: a fan-out of 4 branches in run {run.id} is over FLEET_MAX_FANOUT=3"
    )
    assert run.steps() == [], "nothing of it was recorded"
    ok = small.enqueue("settling", "parallel", 3, 0.0, [])
    inline.drain()
    assert ok.wait(timeout=5) == {"ok": [0, "#1", 2]}, "at the limit is allowed"
    small.runtime.db.dispose()


def test_parallel_given_a_step_instead_of_a_call_fails_the_run_saying_so(
    client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("settling", "bare", 2, 0.0, [])
    inline.drain()
    with pytest.raises(RunFailed) as failed:
        run.wait(timeout=5)
    first = (failed.value.error or "").splitlines()[0]
    assert first == (
        "TypeError: parallel() takes wf.call(...) descriptions, not 'branch': wf.call(branch, ...)"
    )
    assert run.steps() == [], "nothing of it was recorded"


def test_a_run_past_fleet_max_steps_fails_with_one_line_keeping_its_steps(
    backend: Backend, client: Fleet
) -> None:
    small, inline = limited(backend, max_steps=5)
    run = small.enqueue("sprawling", 10)
    inline.drain()
    with pytest.raises(RunFailed) as failed:
        run.wait(timeout=5)
    assert failed.value.error == (
        f"LimitExceeded: run {run.id} reached FLEET_MAX_STEPS=5 steps at step 'branch#6'"
    )
    assert [s.status for s in run.steps()] == ["done"] * 5, "what was recorded stays"
    small.runtime.db.dispose()


@pytest.mark.parametrize("name", ["FLEET_MAX_FANOUT", "FLEET_MAX_STEPS"])
@pytest.mark.parametrize("raw", ["0", "-1", "1e4", "10.5", "many", "²"])
def test_the_limits_must_be_whole_numbers(name: str, raw: str) -> None:
    with pytest.raises(BadInput, match=f"^{name}="):
        Settings.from_env({name: raw})


def test_the_limits_default_to_the_contract() -> None:
    settings = Settings.from_env({})
    assert (settings.max_fanout, settings.max_steps) == (10_000, 100_000)
    assert Settings.from_env({"FLEET_MAX_FANOUT": " 200000 "}).max_fanout == 200_000


def test_a_run_that_ends_revokes_the_leases_of_its_running_steps(client: Fleet) -> None:
    """A run that ends while one of its steps runs (a workflow may return without
    awaiting everything it started) leaves nothing running: the lease goes, as on
    cancel, so the late commit is fenced and the heartbeat fails."""
    ledger = client.runtime.ledger
    assert ledger.create_run("r1", "chain", "1", "{}", '{"args":[],"kwargs":{}}', "q")
    assert ledger.start_run("r1")
    step = NewStep("work#1", 0, "work", StepKind.TASK, '{"args":[1],"kwargs":{}}', 3)
    ledger.record_steps("r1", [step])
    lease = ledger.take_lease("r1", "work#1", "w", 30)
    assert isinstance(lease, Lease)
    assert ledger.finish_run("r1", RunStatus.FAILED, error="ended")
    assert not ledger.heartbeat("r1", "work#1", lease.epoch, 30), "the lease is gone"
    assert not ledger.commit_output("r1", "work#1", lease.epoch, "1"), "its commit is fenced"
    row = client.runtime.queries.step("r1", "work#1")
    assert row is not None and row.status == StepStatus.PENDING and row.output is None
