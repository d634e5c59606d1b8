"""Invariants 2 and 3 at the store: every transition is one conditional write, and
leases are fenced by epochs. Real SQLite and real Postgres, no broker."""

from __future__ import annotations

import threading
import time

from fleet import Fleet
from fleet.states import StepKind
from fleet.store.ledger import Lease, NewStep, TakeRefused
from tests.harness import poll


def _one_step(client: Fleet, run_id: str = "r1", max_attempts: int = 3) -> None:
    ledger = client.runtime.ledger
    assert ledger.create_run(run_id, "chain", "1", "{}", '{"args":[],"kwargs":{}}', "fleet")
    assert ledger.start_run(run_id)
    ledger.record_steps(
        run_id,
        [NewStep("work#1", 0, "work", StepKind.TASK, '{"args":[1],"kwargs":{}}', max_attempts)],
    )


def test_taking_a_lease_bumps_epoch_and_attempts_in_one_write(client: Fleet) -> None:
    _one_step(client)
    lease = client.runtime.ledger.take_lease("r1", "work#1", "a", 30)
    assert isinstance(lease, Lease)
    assert (lease.epoch, lease.attempt) == (1, 1)
    step = client.runtime.queries.step("r1", "work#1")
    assert step is not None
    assert (step.status, step.epoch, step.attempts, step.lease_owner) == ("running", 1, 1, "a")


def test_a_live_lease_refuses_a_second_taker(client: Fleet) -> None:
    _one_step(client)
    ledger = client.runtime.ledger
    assert isinstance(ledger.take_lease("r1", "work#1", "a", 30), Lease)
    assert ledger.take_lease("r1", "work#1", "b", 30) is TakeRefused.LEASE_LIVE


def test_racing_takers_get_exactly_one_lease(client: Fleet) -> None:
    _one_step(client)
    results: list[object] = []
    barrier = threading.Barrier(8)

    def take(i: int) -> None:
        barrier.wait()
        results.append(client.runtime.ledger.take_lease("r1", "work#1", f"w{i}", 30))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sum(isinstance(r, Lease) for r in results) == 1
    assert results.count(TakeRefused.LEASE_LIVE) == 7


def test_an_expired_lease_is_taken_over_and_the_old_epoch_is_fenced(client: Fleet) -> None:
    _one_step(client)
    ledger, q = client.runtime.ledger, client.runtime.queries
    old = ledger.take_lease("r1", "work#1", "zombie", 0.2)
    assert isinstance(old, Lease)
    new = poll(
        lambda: _lease_or_none(ledger.take_lease("r1", "work#1", "b", 30)),
        10,
        "the lease to expire",
    )
    assert (new.epoch, new.attempt, new.took_over) == (2, 2, True)
    assert not ledger.heartbeat("r1", "work#1", old.epoch, 30), "the zombie's heartbeat fails"
    assert not ledger.commit_output("r1", "work#1", old.epoch, '"zombie"'), "fenced"
    assert ledger.commit_output("r1", "work#1", new.epoch, '"fresh"')
    step = q.step("r1", "work#1")
    assert step is not None and (step.output, step.epoch, step.status) == ('"fresh"', 2, "done")
    counts = q.incident_counts("r1")
    assert counts == {"fenced_write": 1, "takeover": 1}
    outcomes = {a.epoch: a.outcome for a in q.attempts("r1")}
    assert outcomes == {1: "fenced", 2: "done"}


def test_heartbeat_keeps_a_lease_alive(client: Fleet) -> None:
    _one_step(client)
    ledger = client.runtime.ledger
    lease = ledger.take_lease("r1", "work#1", "a", 0.5)
    assert isinstance(lease, Lease)
    for _ in range(4):
        time.sleep(0.25)
        assert ledger.heartbeat("r1", "work#1", lease.epoch, 0.5)
    assert ledger.take_lease("r1", "work#1", "b", 30) is TakeRefused.LEASE_LIVE


def test_a_finished_step_refuses_every_later_delivery(client: Fleet) -> None:
    _one_step(client)
    ledger = client.runtime.ledger
    lease = ledger.take_lease("r1", "work#1", "a", 30)
    assert isinstance(lease, Lease)
    assert ledger.commit_output("r1", "work#1", lease.epoch, "1")
    assert ledger.take_lease("r1", "work#1", "b", 30) is TakeRefused.ALREADY_FINISHED
    assert not ledger.commit_output("r1", "work#1", lease.epoch, "2"), "no double commit"


def test_crashed_attempts_spend_the_cap(client: Fleet) -> None:
    _one_step(client, max_attempts=2)
    ledger = client.runtime.ledger
    for _ in range(2):
        poll(
            lambda: _lease_or_none(ledger.take_lease("r1", "work#1", "crashy", 0.1)), 10, "a lease"
        )
    poll(
        lambda: ledger.take_lease("r1", "work#1", "c", 30) is TakeRefused.EXHAUSTED,
        10,
        "the cap to be spent by lost attempts",
    )
    assert ledger.dead_letter(
        "r1",
        "work#1",
        epoch=None,
        workflow="chain",
        error_type="AttemptsExhausted",
        error_message="lost",
        traceback=None,
    )
    step = client.runtime.queries.step("r1", "work#1")
    assert step is not None and (step.status, step.attempts) == ("dead", 2)
    (letter,) = client.runtime.queries.dead_letters("r1")
    assert (letter.step_id, letter.attempts) == ("work#1", 2)
    assert letter.error_type == "AttemptsExhausted"


def test_a_cancelled_run_starts_no_step(client: Fleet) -> None:
    _one_step(client)
    ledger = client.runtime.ledger
    assert ledger.cancel_run("r1", "no longer needed")
    assert ledger.take_lease("r1", "work#1", "a", 30) is TakeRefused.RUN_NOT_LIVE
    assert not ledger.cancel_run("r1", "twice"), "cancel is a transition from a live state only"


def test_enqueue_is_idempotent_on_run_id(client: Fleet) -> None:
    ledger = client.runtime.ledger
    assert ledger.create_run("x", "chain", "1", "{}", "{}", "fleet")
    assert not ledger.create_run("x", "chain", "1", "{}", "{}", "fleet")


def test_recording_the_same_steps_twice_is_a_no_op(client: Fleet) -> None:
    _one_step(client)
    client.runtime.ledger.record_steps(
        "r1", [NewStep("work#1", 0, "work", StepKind.TASK, '{"args":[99],"kwargs":{}}', 3)]
    )
    step = client.runtime.queries.step("r1", "work#1")
    assert step is not None and step.input == '{"args":[1],"kwargs":{}}'


def test_the_sweeper_claims_a_stalled_step_once_per_backoff(client: Fleet) -> None:
    _one_step(client)
    ledger = client.runtime.ledger
    claimed = poll(ledger.claim_stalled_steps, 10, "the step to look stalled")
    assert [c[:2] for c in claimed] == [("r1", "work#1")]
    assert ledger.claim_stalled_steps() == [], "a claim pushes the next re-send out"


def _lease_or_none(result: Lease | TakeRefused) -> Lease | None:
    return result if isinstance(result, Lease) else None
