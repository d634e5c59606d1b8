"""The chaos report's rules on hand-made step logs (no services): which bodies a
freeze would catch, and which second provider calls are a zombie's rather than the
engine's."""

from __future__ import annotations

import json
from typing import Any

from tests.chaos.faults import FREEZE, KILL, Fault
from tests.chaos.freeze import in_flight
from tests.chaos.report import Report, called_after_freeze


def _event(event: str, t: float, epoch: int = 1, pid: int = 7) -> dict[str, Any]:
    return {"run": "r", "step": "charge#1", "epoch": epoch, "pid": pid, "t": t, "event": event}


def test_a_body_is_in_flight_from_its_start_to_its_end_whatever_it_logs_between(tmp_path):
    log = tmp_path / "steps.jsonl"
    events = [_event("start", 1.0), {**_event("call", 1.1), "checked_at": 1.05}]
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert in_flight(log) == {7: [("r", "charge#1", 1)]}
    with log.open("a") as f:
        f.write(json.dumps(_event("end", 1.2)) + "\n")
    assert in_flight(log) == {}
    assert in_flight(tmp_path / "missing.jsonl") == {}


def test_only_a_call_confirmed_before_the_freeze_that_caught_it_is_a_zombies():
    freeze = Fault(FREEZE, at=10.0, pid=7, caught=[("r", "charge#1", 1)])
    checked_before = {**_event("call", 30.0), "checked_at": 9.9}
    checked_after = {**_event("call", 30.0), "checked_at": 29.9}  # its check let it through
    other_epoch = {**_event("call", 30.0, epoch=2), "checked_at": 9.9}
    assert called_after_freeze([checked_before], [freeze]) == {"r:charge#1": 1}
    assert called_after_freeze([checked_after], [freeze]) == {}
    assert called_after_freeze([other_epoch], [freeze]) == {}
    killed = Fault(KILL, at=10.0, pid=7, caught=[("r", "charge#1", 1)])
    assert called_after_freeze([checked_before], [killed]) == {}


def test_a_frozen_attempts_write_after_its_takeover_fails_the_run():
    report = Report(seed=1, runs=1, faults=[])
    assert report.ok
    report.zombies_through.append("r charge#1 epoch 1: done")
    assert not report.ok
    assert "got through the fence" in report.failures[0]
