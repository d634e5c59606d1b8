"""Replay over checkpoints (invariant 4: stable step ids, non-determinism stops the
run), on both stores, with the broker stood in by an in-process list."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet import Fleet, RunFailed
from fleet.worker import live
from fleet.worker.replay import advance
from tests.harness import Backend, InlineBroker, starts


def test_a_run_resumes_from_its_checkpoints(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("chain", 4)
    inline.drain()
    assert run.wait(timeout=5) == 0 + 1 + 4 + 9
    assert [s.id for s in run.steps()] == ["work#1", "work#2", "work#3", "work#4"]
    # Replaying a finished history again re-runs nothing.
    advance(client.runtime, run.id)
    assert starts(backend, run.id) == {f"work#{i}": 1 for i in range(1, 5)}


def test_a_replay_runs_only_the_unfinished_step(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("chain", 5)
    inline.drain(until=lambda: len(run.steps()) == 3)  # work#3 recorded, not yet run
    assert starts(backend, run.id) == {"work#1": 1, "work#2": 1}
    inline.sent.clear()  # every message lost: a fresh replay must find work#3 itself
    advance(client.runtime, run.id)
    assert inline.sent == [], "work#3 was dispatched already; the sweeper re-sends it if lost"
    from fleet.worker.attempt import execute

    execute(client.runtime, run.id, "work#3")
    inline.drain()
    assert run.wait(timeout=5) == 0 + 1 + 4 + 9 + 16
    assert starts(backend, run.id) == {f"work#{i}": 1 for i in range(1, 6)}


def test_changed_step_sequence_is_a_non_determinism_error(
    client: Fleet, inline: InlineBroker, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    run = client.enqueue("drifting", str(marker))
    inline.drain(until=lambda: any(s.id == "work#2" for s in run.steps()))
    marker.write_text("the code changed between replays")
    live.RUNS.clear()  # a code change is a new process: it keeps no parked workflow
    advance(client.runtime, run.id)
    with pytest.raises(RunFailed) as failed:
        run.wait(timeout=5)
    error = failed.value.error or ""
    assert "non-determinism" in error
    assert "'other#1'" in error and "'work#2'" in error
    assert client.runtime.queries.incident_counts(run.id) == {"nondeterminism": 1}


def test_now_and_random_are_recorded(client: Fleet, inline: InlineBroker) -> None:
    run = client.enqueue("values")
    inline.drain()
    result = run.wait(timeout=5)
    recorded = {s.step_id: s.output for s in client.runtime.queries.steps(run.id)}
    assert set(recorded) == {"now#1", "random#1", "work#1", "now#2"}
    # Replayed twice (before and after work#1), yet each kept its first value.
    assert float(recorded["now#1"]) == result["now"]
    assert float(recorded["random#1"]) == result["random"]
    assert result["now_again"] >= result["now"]


def test_a_dead_step_can_be_caught_in_the_workflow(
    backend: Backend, client: Fleet, inline: InlineBroker
) -> None:
    run = client.enqueue("guarded")
    inline.drain()
    assert run.wait(timeout=5) == "caught refuse#1"
    (letter,) = client.runtime.queries.dead_letters(run.id)
    assert (letter.step_id, letter.error_type, letter.attempts) == ("refuse#1", "NonRetryable", 1)
    assert starts(backend, run.id) == {"refuse#1": 1}, "non-retryable: one attempt"


@pytest.mark.parametrize("how", ["unknown-step", "non-retryable"])
def test_a_fleet_error_raised_by_workflow_code_fails_the_run_once(
    client: Fleet, inline: InlineBroker, how: str
) -> None:
    """Only a store outage leaves a run for the sweeper to advance again; any other of
    fleet's errors raised while replaying is the workflow's failure, recorded once."""
    run = client.enqueue("misuses_fleet", how)
    inline.drain()
    with pytest.raises(RunFailed):
        run.wait(timeout=5)
    row = client.runtime.queries.run(run.id)
    assert row.advanced_seq == row.wake_seq, "the sweeper would advance it again"
