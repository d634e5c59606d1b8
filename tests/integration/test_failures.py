"""Invariant 6: retries are policy, not luck. Real workers on both backends."""

from __future__ import annotations

from typing import Any

import pytest

from fleet import Fleet, RunFailed
from fleet.states import StepStatus
from fleet.store.ledger import TakeRefused
from fleet.store.schema import steps
from fleet.worker.failures import refused
from tests.e2e.test_cli import fleet_cli
from tests.harness import Backend, Cluster, InlineBroker, poll, starts
from tests.integration.test_transitions import STEP, _force, _lease, _run, _run_row, _step_row


def test_fails_twice_then_succeeds_with_policy_delays(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("retrying", 2)
    assert run.wait(timeout=60) == 3
    tries = [a for a in client.runtime.queries.attempts(run.id) if a.step_id == "flaky#1"]
    assert [a.outcome for a in tries] == ["failed", "failed", "done"]
    # FIXED: 0.5 s then 1.0 s, no jitter; the store's clock is the one that counts.
    gaps = [b.started_at - a.finished_at for a, b in zip(tries, tries[1:], strict=False)]
    assert 0.5 - 0.05 <= gaps[0] <= 0.5 + 2.0, gaps
    assert 1.0 - 0.05 <= gaps[1] <= 1.0 + 2.0, gaps
    assert starts(backend, run.id) == {"flaky#1": 3}
    assert client.dead_letters() == []


def test_non_retryable_is_dead_lettered_at_once_and_fails_the_run(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("refusing")
    with pytest.raises(RunFailed) as failed:
        run.wait(timeout=60)
    assert "StepFailed" in (failed.value.error or "") and "permission denied" in (
        failed.value.error or ""
    )
    assert starts(backend, run.id) == {"refuse#1": 1}
    (letter,) = client.dead_letters(run_id=run.id)
    assert (letter.step_id, letter.attempts, letter.error_type) == ("refuse#1", 1, "NonRetryable")
    assert letter.input == {"args": ["permission denied"], "kwargs": {}}
    assert "Traceback" in (letter.traceback or "")
    assert letter.first_failed_at <= letter.last_failed_at
    # The hook heard about it once, and its own failure hurt nothing.
    poll(lambda: backend.hook_calls(), 10, "the on_dead_letter hook")
    assert [c["step"] for c in backend.hook_calls()] == ["refuse#1"]
    status = fleet_cli(backend, "status", run.id)
    assert status.returncode == 1 and "permission denied" in status.stdout

    caught = client.enqueue("guarded")
    assert caught.wait(timeout=60) == "caught refuse#1"


def test_a_step_that_kills_its_worker_is_dead_lettered_after_its_cap(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1", concurrency=1, pool="prefork")
    cluster.sweeper()
    run = client.enqueue("crashing")
    with pytest.raises(RunFailed):
        run.wait(timeout=90)
    (letter,) = client.dead_letters(run_id=run.id)
    assert (letter.error_type, letter.attempts) == ("AttemptsExhausted", 3)
    assert starts(backend, run.id) == {"crash#1": 3}, "three attempts, then no more"
    step = client.runtime.queries.step(run.id, "crash#1")
    assert step is not None and (step.status, step.attempts) == ("dead", 3)


def test_fan_out_item_dead_lettered_then_replayed_from_the_cli(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    marker = backend.workdir / "fixed"
    run = client.enqueue("fanout", str(marker))
    with pytest.raises(RunFailed):
        run.wait(timeout=60)
    done = [s.id for s in run.steps() if s.status == "done"]
    assert sorted(done) == ["maybe#1", "maybe#2", "maybe#3", "maybe#5"]
    (letter,) = client.dead_letters(run_id=run.id)
    assert (letter.step_id, letter.attempts) == ("maybe#4", 2)

    listed = fleet_cli(backend, "dlq", "list", "--workflow", "fanout")
    assert listed.returncode == 0 and "maybe#4" in listed.stdout
    shown = fleet_cli(backend, "dlq", "show", str(letter.id))
    assert shown.returncode == 0 and "upstream rejected item 3" in shown.stdout

    marker.write_text("the cause is fixed")
    replayed = fleet_cli(backend, "dlq", "replay", str(letter.id))
    assert replayed.returncode == 0, replayed.stderr
    assert run.wait(timeout=60) == [0, 10, 20, 30, 40]
    ran = starts(backend, run.id)
    assert ran == {"maybe#1": 1, "maybe#2": 1, "maybe#3": 1, "maybe#4": 3, "maybe#5": 1}
    assert client.dead_letters() == [], "replayed letters are no longer outstanding..."
    (kept,) = client.dead_letters(include_replayed=True)
    assert kept.replayed_at is not None, "...but the history stays"
    again = fleet_cli(backend, "dlq", "replay", str(letter.id))
    assert again.returncode == 2 and "already replayed" in again.stderr


def test_map_with_return_exceptions_lets_the_other_branches_go_on(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    run = client.enqueue("fanout", str(backend.workdir / "never"), True)
    assert run.wait(timeout=60) == [0, 10, 20, "failed: maybe#4", 40]


def test_a_retry_due_after_the_visibility_timeout_runs_once_per_attempt(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    # A 1 s visibility timeout: Redis would redeliver a held countdown message while it
    # waits; the retry (3 s out) is kept in the store and sent by the sweeper instead.
    backend.extra_env["FLEET_VISIBILITY_TIMEOUT"] = "1"
    cluster.worker("w1")
    cluster.worker("w2")
    cluster.sweeper()
    run = client.enqueue("retry_later", 3.0)
    assert run.wait(timeout=60) == 2
    assert starts(backend, run.id) == {"later#1": 2}
    tries = [a for a in client.runtime.queries.attempts(run.id)]
    assert tries[1].started_at - tries[0].finished_at >= 3.0 - 0.05


def test_bulk_replay_and_replay_with_edited_input(
    backend: Backend, client: Fleet, cluster: Cluster
) -> None:
    cluster.worker("w1")
    missing = str(backend.workdir / "still-broken")
    runs = [client.enqueue("fanout", missing) for _ in range(3)]
    for run in runs:
        with pytest.raises(RunFailed):
            run.wait(timeout=60)
    first, *rest = client.dead_letters(workflow="fanout")
    assert len(rest) == 2

    # One, with its input edited: item 3 pointed at a marker that exists.
    fixed = backend.workdir / "fixed"
    fixed.write_text("ok")
    edited = fleet_cli(backend, "dlq", "replay", str(first.id), "--input", f'[[3, "{fixed}"]]')
    assert edited.returncode == 0, edited.stderr
    assert client.run(first.run_id).wait(timeout=60) == [0, 10, 20, 30, 40]

    # The rest in bulk, rate-limited, after the cause is fixed for them too.
    backend.workdir.joinpath("still-broken").write_text("ok")
    bulk = fleet_cli(backend, "dlq", "replay", "--all", "--workflow", "fanout", "--rate", "5")
    assert bulk.returncode == 0 and "2 dead letter(s) replayed" in bulk.stdout, bulk.stderr
    for run in runs:
        assert run.wait(timeout=60) == [0, 10, 20, 30, 40]
    assert client.dead_letters() == []
    assert len(client.dead_letters(include_replayed=True)) == 3


def _refused_not_due(client: Fleet, inline: InlineBroker, **state: Any) -> list[Any]:
    """Step ``work#1`` of run ``r1`` put in retry_wait, then in ``state``, and refused as
    not due: the messages the refusal sent."""
    _run(client)
    lease = _lease(client)
    ledger = client.runtime.ledger
    assert ledger.schedule_retry("r1", STEP, lease.epoch, 60, "E: x", countdown=False)
    _force(client, steps, **state)
    assert ledger.take_lease("r1", STEP, "w", 30) is TakeRefused.NOT_DUE
    inline.sent.clear()
    refused(client.runtime, _run_row(client), STEP, TakeRefused.NOT_DUE)
    return inline.sent


def test_a_retry_delivered_early_is_sent_again_if_due_by_the_time_it_looks(
    client: Fleet, inline: InlineBroker
) -> None:
    """The refusal (not due) and the read of how long is left straddled the due time:
    the message is sent again at once, not dropped (only the sweeper would find it).
    The straddle is made by moving the due time into the past after the refusal."""
    _run(client)
    lease = _lease(client)
    ledger = client.runtime.ledger
    assert ledger.schedule_retry("r1", STEP, lease.epoch, 60, "E: x", countdown=False)
    assert ledger.take_lease("r1", STEP, "w", 30) is TakeRefused.NOT_DUE
    _force(client, steps, due_at=_step_row(client).due_at - 120)  # due by now
    inline.sent.clear()
    refused(client.runtime, _run_row(client), STEP, TakeRefused.NOT_DUE)
    assert inline.sent == [("fleet.execute", ["r1", STEP])]


def test_a_step_refused_as_not_due_for_another_reason_is_not_sent_again_at_once(
    client: Fleet, inline: InlineBroker
) -> None:
    """An effect in doubt is refused as not due too; its past due time must not make a
    message that comes straight back refused, again and again."""
    assert _refused_not_due(client, inline, status=StepStatus.IN_DOUBT, due_at=0.0) == []
