"""The chaos checks (tests/chaos/checks.py), each shown to fail on a bad input and to
hold on a good one: captures of runs recorded in this process on SQLite, then made bad
by writing rows directly; hand-made limit logs and provider call logs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from fleet import Fleet
from fleet.testing import InlineBroker
from tests import replay_flows
from tests.chaos.checks import (
    capture,
    check_effects,
    check_overlap,
    check_replays,
    check_settled,
    intervals,
    read_lines,
)
from tests.harness import make_backend

APPROVED = {"approved": True, "by": "ann"}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    client = replay_flows.fleet.with_settings(make_backend("sqlite", tmp_path).settings())
    client.upgrade_schema()
    yield client
    client.runtime.db.dispose()


def _run(fleet: Fleet, strict: bool = False, decision: dict[str, Any] = APPROVED) -> str:
    broker = InlineBroker(fleet)
    run = fleet.enqueue("agent", "checks", strict)
    broker.drain()
    fleet.signal(run.id, "approval", decision)
    broker.drain()
    return run.id


def _write(fleet: Fleet, sql: str, **params: Any) -> None:
    """A row changed behind the engine's back: what a bug would leave."""
    with fleet.runtime.db.begin() as conn:
        assert conn.execute(text(sql), params).rowcount == 1


def test_a_capture_is_plain_json_with_the_runs_end_steps_children_and_replay(
    fleet: Fleet,
) -> None:
    run_id = _run(fleet)
    got = capture(fleet, run_id)
    assert got is not None
    assert json.loads(json.dumps(got)) == got
    assert (got["status"], got["result"]["total"]) == ("succeeded", 54)
    assert [s["id"] for s in got["steps"]][:2] == ["think#1", "random#1"]
    think = got["steps"][0]
    assert (think["status"], think["attempts"], think["epoch"]) == ("done", 1, 1)
    assert [t["outcome"] for t in think["tries"]] == ["done"]
    assert got["children"] == [
        {"id": f"{run_id}/helper", "parent": run_id, "status": "succeeded", "detached": False}
    ]
    assert got["dead_letters"] == []
    assert got["replay"]["status"] == "finished"
    assert got["replay"]["result"] == got["result"]
    assert capture(fleet, "no-such-run") is None


def test_settled_fails_on_a_step_or_child_left_behind_a_finished_run(fleet: Fleet) -> None:
    good, bad = _run(fleet), _run(fleet)
    assert check_settled([capture(fleet, good)]) == []
    _write(
        fleet,
        "UPDATE fleet_steps SET status = 'pending' WHERE run_id = :r AND step_id = 'double#2'",
        r=bad,
    )
    _write(fleet, "UPDATE fleet_runs SET status = 'running' WHERE id = :r", r=f"{bad}/helper")
    assert check_settled([capture(fleet, good), capture(fleet, bad)]) == [
        f"run {bad} is succeeded but its step double#2 is pending",
        f"child run {bad}/helper is running but its parent {bad} is succeeded",
    ]


def test_settled_lets_a_cancelled_run_keep_steps_no_one_will_take(fleet: Fleet) -> None:
    broker = InlineBroker(fleet)
    run = fleet.enqueue("agent", "checks")
    broker.drain()  # waiting for approval
    fleet.cancel(run.id, reason="enough")
    got = capture(fleet, run.id)
    assert got is not None and got["status"] == "cancelled"
    assert "pending" in {s["status"] for s in got["steps"]}, "its open wait"
    assert check_settled([got]) == []
    for s in got["steps"]:
        if s["id"] == "think#1":
            s["status"] = "running"  # a lease the cancel did not revoke
    assert check_settled([got]) == [f"run {run.id} is cancelled but its step think#1 is running"]


def test_replays_fail_when_the_runs_end_is_not_its_replays(fleet: Fleet) -> None:
    ok, failed = _run(fleet), _run(fleet, strict=True, decision={"approved": False, "by": "b"})
    good = [capture(fleet, ok), capture(fleet, failed)]
    assert good[1] is not None and good[1]["status"] == "failed"
    assert check_replays(good) == []
    _write(fleet, "UPDATE fleet_runs SET result = '{\"total\": 1}' WHERE id = :r", r=ok)
    _write(fleet, "UPDATE fleet_runs SET error = 'RuntimeError: other' WHERE id = :r", r=failed)
    _write(
        fleet,
        "UPDATE fleet_steps SET status = 'pending', output = NULL "
        "WHERE run_id = :r AND step_id = 'summarize#1'",
        r=f"{ok}",
    )
    bad = [capture(fleet, ok), capture(fleet, failed)]
    assert check_replays(bad) == [
        f"run {ok} succeeded but its replay is suspended before summarize#1",
        f"run {failed} failed with 'RuntimeError: other' but its replay with "
        "'RuntimeError: rejected by b'",
    ]
    _write(
        fleet,
        "UPDATE fleet_steps SET status = 'done', output = '\"x\"' "
        "WHERE run_id = :r AND step_id = 'summarize#1'",
        r=ok,
    )
    (differs,) = check_replays([capture(fleet, ok)])
    assert differs.startswith(f'run {ok} succeeded with {{"total":1}} but its replay returns')


def _limit(event: str, t: float, step: str, pid: int = 1, epoch: int = 1) -> dict[str, Any]:
    return {
        "run": "r",
        "step": step,
        "epoch": epoch,
        "pid": pid,
        "t": t,
        "limit": "chaos-conc",
        "event": event,
    }


def test_overlap_fails_on_three_bodies_inside_a_limit_of_two() -> None:
    two = [
        _limit("enter", 1.0, "a"),
        _limit("enter", 1.5, "b", pid=2),
        _limit("exit", 2.0, "a"),
        _limit("enter", 2.0, "c"),  # the slot "a" gave back, at the same instant
        _limit("exit", 3.0, "b", pid=2),
        _limit("exit", 3.0, "c"),
    ]
    assert check_overlap(two, {"chaos-conc": 2}) == []
    three = [*two, _limit("enter", 2.5, "d", pid=3), _limit("exit", 2.9, "d", pid=3)]
    (failure,) = check_overlap(three, {"chaos-conc": 2})
    assert failure.startswith("limit chaos-conc (concurrency 2) had 3 bodies inside at t=2.500")
    assert "step b epoch 1 (pid 2)" in failure and "step d epoch 1 (pid 3)" in failure
    assert check_overlap(three, {"other-limit": 2}) == [], "only the limits given"


def test_overlap_closes_a_body_at_its_process_kill_or_freeze() -> None:
    killed = [
        _limit("enter", 1.0, "a", pid=9),  # killed at 1.2: no exit ever comes
        _limit("enter", 2.0, "a", pid=2, epoch=2),  # the takeover
        _limit("enter", 2.1, "b", pid=3),
        _limit("exit", 3.0, "a", pid=2, epoch=2),
        _limit("exit", 3.0, "b", pid=3),
    ]
    assert check_overlap(killed, {"chaos-conc": 2}, stopped={9: 1.2}) == []
    # Not known to be stopped: inside until the log's end, over the limit.
    assert len(check_overlap(killed, {"chaos-conc": 2})) == 1
    # Frozen at 1.2, thawed: its exit at 5.0 comes after the freeze and does not count.
    frozen = [*killed, _limit("exit", 5.0, "a", pid=9)]
    assert check_overlap(frozen, {"chaos-conc": 2}, stopped={9: [0.5, 1.2]}) == []
    assert intervals(frozen, {9: 1.2})["chaos-conc"][0][:2] == (1.0, 1.2)


def test_read_lines_leaves_out_a_line_cut_short(tmp_path: Path) -> None:
    log = tmp_path / "limits.jsonl"
    log.write_text(json.dumps(_limit("enter", 1.0, "a")) + "\n" + '{"run": "r", "st')
    assert read_lines(log) == [_limit("enter", 1.0, "a")]
    assert read_lines(tmp_path / "missing.jsonl") == []


def _call(key: str, applied: bool) -> dict[str, Any]:
    return {"key": key, "body": "b", "applied": applied}


def test_effects_fail_on_a_double_application_a_lost_one_and_an_unexpected_one() -> None:
    once = [_call("r1:pay#1", True), _call("r1:pay#1", False), _call("r2:pay#1", True)]
    assert check_effects(once, ["r1:pay#1", "r2:pay#1"]) == [], "a repeated call is absorbed"
    twice = [*once, _call("r2:pay#1", True)]
    assert check_effects(twice, ["r1:pay#1", "r2:pay#1"]) == ["effect r2:pay#1 was applied 2 times"]
    assert check_effects(once, ["r1:pay#1", "r2:pay#1", "r3:pay#1"]) == [
        "effect r3:pay#1 was never applied (lost)"
    ]
    assert check_effects(once, ["r1:pay#1"]) == [
        "effect r2:pay#1 was applied though no run expects it"
    ]
    assert check_effects(once, ["r1:pay#1"], allowed=["r2:pay#1"]) == []
