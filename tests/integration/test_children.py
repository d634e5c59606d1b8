"""Child runs (subagents, DESIGN invariant 11): a child run's id derives from its
parent's run and step, so a replayed parent never starts a second one; its end settles
the parent's step and wakes the parent; a parent that is cancelled or ends leaves none
of its own children running (detached ones excepted); spend rolls up. Both stores;
real workers where a worker is killed or a step must be running."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from fleet import BadInput, Fleet
from fleet.states import RunStatus, StepKind, StepStatus
from fleet.worker.replay import advance
from fleet.worker.sweeper import sweep_once
from tests.e2e.test_cli import fleet_cli
from tests.harness import Backend, Cluster, InlineBroker, find_event, poll, starts


def _children(client: Fleet, run_id: str) -> list[Any]:
    """The child runs of ``run_id`` in the store (not by id: by their parent_id)."""
    return [r for r in client.runtime.queries.runs(limit=1000) if r.parent_id == run_id]


def test_a_child_result_is_returned_to_its_parent_once(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("parent", 4)
    inline.drain()
    assert run.wait(timeout=5) == {"before": 1, "child": 16, "after": -3}
    (child,) = _children(client, run.id)
    assert child.id == f"{run.id}/kid#1" and child.parent_step == "kid#1"
    assert (child.workflow, child.status, child.detached) == ("kid", "succeeded", False)
    step = client.runtime.queries.step(run.id, "kid#1")
    assert step is not None and (step.kind, step.status) == (StepKind.CHILD, StepStatus.DONE)
    assert starts(backend, child.id) == {"work#1": 1}
    # Replays of the finished parent, or a second advance of the child, start nothing.
    advance(client.runtime, run.id)
    advance(client.runtime, child.id)
    inline.drain()
    assert len(_children(client, run.id)) == 1


def test_a_childs_end_wakes_its_parent_in_the_store_for_the_sweeper(
    client: Fleet, inline: InlineBroker
) -> None:
    """The advance a child's end sends its parent may be lost (the broker is a hint):
    the end marks the parent woken in the store too, and the sweeper sends the advance
    again (fails without that wake-up: the parent waits forever on a settled child)."""
    run = client.enqueue("parent", 4)
    rt = client.runtime

    def child_ended() -> bool:
        child = rt.queries.run(f"{run.id}/kid#1")
        return child is not None and child.status == RunStatus.SUCCEEDED

    inline.drain(until=child_ended)
    inline.sent.clear()  # the broker lost every message: the parent's advance with them
    poll(lambda: sweep_once(rt).runs, 10, "the sweeper to re-send the parent's advance")
    inline.drain()
    assert run.wait(timeout=5) == {"before": 1, "child": 16, "after": -3}


def test_a_replayed_parent_does_not_start_a_second_child(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("parent", 2, key="sub")
    inline.drain(until=lambda: len(_children(client, run.id)) == 1)
    for _ in range(3):  # the parent replayed while its child has not run: no new child
        advance(client.runtime, run.id)
    assert [c.id for c in _children(client, run.id)] == [f"{run.id}/sub"]
    inline.drain()
    assert run.wait(timeout=5)["child"] == 4
    assert starts(backend, f"{run.id}/sub") == {"work#1": 1}
    assert len(_children(client, run.id)) == 1


def test_a_failing_child_raises_child_failed_which_the_parent_may_catch(
    client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("parent", -1, catch=True)
    inline.drain()
    got = run.wait(timeout=5)["child"]
    assert got["step"] == "failing_kid#1" and got["is_step_failed"]
    assert f"child run {run.id}/failing_kid#1 failed" in got["caught"]
    assert "item" not in got["caught"] and "no" in got["caught"]


def test_an_uncaught_child_failure_fails_the_parent(client: Fleet, inline: InlineBroker) -> None:
    run = client.enqueue("parent", -1)
    inline.drain()
    row = client.runtime.queries.run(run.id)
    assert row is not None and row.status == RunStatus.FAILED
    first = (row.error or "").splitlines()[0]
    assert first.startswith("StepFailed: child failing_kid#1 failed: child run ")
    assert "other#1" not in {s.step_id for s in client.runtime.queries.steps(run.id)}


def test_start_child_runs_several_at_once_then_gives_their_results(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", concurrency=4)
    cluster.sweeper()
    run = client.enqueue("brood", 3, 1.0)
    assert run.wait(timeout=60) == [0, 1, 4]
    kids = sorted(_children(client, run.id), key=lambda r: r.id)
    assert [k.id for k in kids] == [f"{run.id}/kid-{i}" for i in range(3)]
    spans = [
        (find_event(backend, k.id, "work#1", "start"), find_event(backend, k.id, "work#1", "end"))
        for k in kids
    ]
    assert all(s and e for s, e in spans)
    # Each child's step started before any ended: they ran together.
    assert max(s["t"] for s, _ in spans) < min(e["t"] for _, e in spans)  # type: ignore[index]


def test_a_child_id_over_the_limit_fails_the_parent_with_one_line(
    client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("parent", 2, key="k" * 190)
    inline.drain()
    row = client.runtime.queries.run(run.id)
    assert row is not None and row.status == RunStatus.FAILED
    assert (row.error or "").startswith("LimitExceeded: child run id ")
    assert "over the 200 a run id may have" in (row.error or "")
    # Named as the API spells each way of starting a child (issue 48).
    assert "(wf.child, wf.start_child, wf.call) a shorter key=" in (row.error or "")
    assert "\n" not in (row.error or "")
    assert _children(client, run.id) == []


def test_spend_of_children_rolls_up_into_the_parent(client: Fleet, inline: InlineBroker) -> None:
    run = client.enqueue("parent", 2, budget={"tokens": 100})
    inline.drain()
    assert run.wait(timeout=5)["child"] == 4
    (child,) = _children(client, run.id)
    # work(1) in the parent spent 11 tokens; the child asked for 500, capped at 89 left.
    assert child.budget_tokens == 89
    assert client.run(child.id).usage()["tokens"] == 12
    assert run.usage()["tokens"] == 11 + 12
    assert run.usage()["calls"] == 2


def _settled_attempts(client: Fleet, run_id: str) -> list[Any]:
    """Its attempts, once none is still running (each body has returned and reported)."""
    found = client.runtime.queries.attempts(run_id)
    return found if found and all(a.outcome != "running" for a in found) else []


def test_cancelling_a_parent_cancels_its_three_running_children(
    backend: Backend, client: Fleet, cluster: Cluster, tmp_path: Path
) -> None:
    cluster.worker("w1", concurrency=6)
    cluster.sweeper()
    gate = tmp_path / "open"
    run = client.enqueue("gated_brood", 3, str(gate))
    kids = [f"{run.id}/g{i}" for i in range(3)]
    poll(
        lambda: all(find_event(backend, k, "gate#1", "start") for k in kids),
        30,
        "the three children's steps to be running",
    )
    assert client.cancel(run.id, "enough")
    q = client.runtime.queries
    for rid in [run.id, *kids]:
        row = q.run(rid)
        assert row is not None and row.status == RunStatus.CANCELLED, rid
    gate.touch()  # the three bodies return now: their commits must be fenced
    for k in kids:
        attempts = poll(lambda k=k: _settled_attempts(client, k), 30, f"{k}'s attempt to end")
        assert [a.outcome for a in attempts] == ["fenced"], k
        step = q.step(k, "gate#1")
        assert step is not None and step.status == StepStatus.PENDING and step.output is None
        assert q.run(k).status == RunStatus.CANCELLED  # type: ignore[union-attr]
    parent_steps = {s.step_id: s for s in q.steps(run.id)}
    assert {s.status for s in parent_steps.values()} == {StepStatus.DEAD}
    assert "cancelled" in (parent_steps["g0"].error or "")


def test_a_parent_that_ends_cancels_its_child_but_not_a_detached_one(
    backend: Backend, client: Fleet, cluster: Cluster, tmp_path: Path
) -> None:
    cluster.worker("w1", concurrency=4)
    cluster.sweeper()
    gate = tmp_path / "open"
    run = client.enqueue("deserter", str(gate))
    assert run.wait(timeout=30) == "gone"
    q = client.runtime.queries
    attached, detached = q.run(f"{run.id}/attached"), q.run(f"{run.id}/detached")
    assert attached is not None and attached.status == RunStatus.CANCELLED
    assert attached.error == f"cancelled: parent run {run.id} ended"
    assert detached is not None and detached.detached
    assert not RunStatus(detached.status).finished, "a detached child outlives its parent"
    poll(lambda: find_event(backend, detached.id, "gate#1", "start"), 30, "the detached step")
    gate.touch()
    assert client.run(detached.id).wait(timeout=30) == 1
    assert all(a.outcome != "done" for a in q.attempts(attached.id))
    step = q.step(attached.id, "gate#1")  # None: cancelled before its first advance
    assert step is None or step.status != StepStatus.DONE


def test_a_killed_worker_running_a_childs_step_costs_one_step_and_no_second_child(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    cluster.worker("w2")
    cluster.sweeper()
    run = client.enqueue("parent", 5, 60.0)  # the child's work#1 holds its first attempt
    child = f"{run.id}/kid#1"
    victim = poll(
        lambda: find_event(backend, child, "work#1", "start", attempt=1), 30, "the child's step"
    )
    cluster.by_pid(victim["pid"]).signal(signal.SIGKILL)

    assert run.wait(timeout=90) == {"before": 1, "child": 25, "after": -3}
    assert starts(backend, child) == {"work#1": 2}, "the killed step ran again, once"
    assert starts(backend, run.id) == {"work#1": 1, "other#1": 1}
    assert [c.id for c in _children(client, run.id)] == [child]
    assert client.runtime.queries.run(child).status == RunStatus.SUCCEEDED  # type: ignore[union-attr]
    step = client.runtime.queries.step(run.id, "kid#1")
    assert step is not None and step.output == "25"


def test_fleet_status_shows_the_tree_and_fleet_runs_can_hide_children(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("parent", 2, run_id="tree-top")
    inline.drain()
    assert run.wait(timeout=5)["child"] == 4
    status = fleet_cli(backend, "status", "-A", "tests.flows", run.id)
    assert status.returncode == 0, status.stderr
    assert "child runs of tree-top" in status.stdout
    line = next(x for x in status.stdout.splitlines() if "tree-top/kid#1" in x)
    assert "kid" in line and "succeeded" in line
    child = fleet_cli(backend, "status", "-A", "tests.flows", "tree-top/kid#1")
    assert "tree-top (its step kid#1)" in child.stdout
    doc = json.loads(fleet_cli(backend, "status", "--json", "tree-top").stdout)
    assert doc["children"] == [
        {"id": "tree-top/kid#1", "parent": "tree-top", "workflow": "kid", "status": "succeeded"}
    ]
    listed = fleet_cli(backend, "runs").stdout
    assert "tree-top/kid#1" in listed and "tree-top" in listed
    top_only = fleet_cli(backend, "runs", "--no-children")
    assert top_only.returncode == 0, top_only.stderr
    assert "tree-top/kid#1" not in top_only.stdout and "tree-top" in top_only.stdout


def test_a_parent_budget_bounds_its_tree(client: Fleet, inline: InlineBroker) -> None:
    run = client.enqueue("parent", 2, budget={"tokens": 20})
    inline.drain()
    (child,) = _children(client, run.id)
    assert child.budget_tokens == 20 - 11, "capped at what the parent had left"
    # The child spent 12 tokens (past its cap, in its one step): the tree's 23 reach the
    # parent's 20, so the parent's next step does not start.
    row = client.runtime.queries.run(run.id)
    assert row is not None and (row.status, row.decision) == (RunStatus.NEEDS_DECISION, "budget")
    other = client.runtime.queries.step(run.id, "other#1")
    assert other is not None and other.attempts == 0
    assert run.usage()["tokens"] == 23


def test_parallel_runs_a_child_workflow_beside_a_step(client: Fleet, inline: InlineBroker) -> None:
    run = client.enqueue("mixed")
    inline.drain()
    assert run.wait(timeout=5) == [-2, 9]
    assert [c.id for c in _children(client, run.id)] == [f"{run.id}/sub"]


def test_a_run_id_with_a_slash_is_refused_it_could_stand_in_for_a_child(
    client: Fleet, inline: InlineBroker
) -> None:
    parent = client.enqueue("parent", 2, run_id="p")
    with pytest.raises(BadInput, match=r"^run id 'p/kid#1' has a '/': those are child runs' ids$"):
        client.enqueue("kid", 1, run_id="p/kid#1")
    inline.drain()
    assert parent.wait(timeout=5)["child"] == 4, "its own child ran, not an impostor"
    (child,) = _children(client, parent.id)
    assert child.id == "p/kid#1" and child.workflow == "kid"
