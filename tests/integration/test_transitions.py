"""One test per entry of ``fleet.states.TRANSITIONS``, named after it: the transition
applies from a source it allows, and is refused (zero rows, the ledger's named
outcome, nothing written) from a state outside its sources. Real SQLite and real
Postgres, no broker. A row is put in a state the test needs by writing its status
directly (``_force``): the statements under test re-check it, whatever led there.
"""

from __future__ import annotations

import sys
from typing import Any

from sqlalchemy import select, update

from fleet import Fleet
from fleet.states import TRANSITIONS, RunStatus, StepKind, StepStatus
from fleet.store import transitions as sql
from fleet.store.ledger import Committed, Lease, NewChild, NewStep, ReplayRefused, TakeRefused
from fleet.store.schema import runs, signals, steps

STEP = "work#1"


def _run(client: Fleet, run_id: str = "r1", *, max_attempts: int = 3, **budget: Any) -> None:
    """A running run with one pending task step."""
    ledger = client.runtime.ledger
    assert ledger.create_run(run_id, "chain", "1", "{}", '{"args":[],"kwargs":{}}', "q", **budget)
    assert ledger.start_run(run_id)
    step = NewStep(STEP, 0, "work", StepKind.TASK, '{"args":[1],"kwargs":{}}', max_attempts)
    ledger.record_steps(run_id, [step])


def _wait(client: Fleet, step_id: str, name: str, delay: float | None = None) -> None:
    step = NewStep(step_id, 1, name, StepKind.WAIT, "{}", 1, delay=delay)
    client.runtime.ledger.record_steps("r1", [step])


def _lease(client: Fleet, run_id: str = "r1") -> Lease:
    lease = client.runtime.ledger.take_lease(run_id, STEP, "w", 30)
    assert isinstance(lease, Lease)
    return lease


def _force(client: Fleet, table: Any, **values: Any) -> None:
    """Put the row of ``r1`` (its step ``work#1``) in a state, bypassing the ledger."""
    where = [table.c.id == "r1"] if table is runs else [table.c.run_id == "r1"]
    if table is steps:
        where.append(steps.c.step_id == values.pop("step_id", STEP))
    with client.runtime.db.begin() as conn:
        conn.execute(update(table).where(*where).values(**values))


def _run_row(client: Fleet) -> Any:
    run = client.runtime.queries.run("r1")
    assert run is not None
    return run


def _step_row(client: Fleet, step_id: str = STEP) -> Any:
    step = client.runtime.queries.step("r1", step_id)
    assert step is not None
    return step


def _rows(client: Fleet, stmt: Any, **params: Any) -> int:
    """Run one prebuilt statement on its own: the rows it changed."""
    with client.runtime.db.begin() as conn:
        return int(conn.execute(stmt, params).rowcount)


def _dead(client: Fleet) -> int:
    """A running run whose step was dead-lettered; the letter's id."""
    _run(client)
    lease = _lease(client)
    letter = client.runtime.ledger.dead_letter(
        "r1",
        STEP,
        epoch=lease.epoch,
        workflow="chain",
        error_type="ValueError",
        error_message="no",
        traceback=None,
    )
    assert letter is not None
    return letter


def _in_doubt(client: Fleet) -> None:
    _run(client)
    lease = _lease(client)
    assert client.runtime.ledger.park_in_doubt("r1", STEP, lease.epoch)


# --- runs ---------------------------------------------------------------------------


def test_start_run(client: Fleet) -> None:
    ledger = client.runtime.ledger
    assert ledger.create_run("r1", "chain", "1", "{}", "{}", "q")
    assert _run_row(client).status == RunStatus.QUEUED
    assert ledger.start_run("r1")
    assert _run_row(client).status == RunStatus.RUNNING
    assert not ledger.start_run("r1"), "running is not queued: a second advance starts nothing"


def test_set_waiting(client: Fleet) -> None:
    _run(client)
    assert client.runtime.ledger.set_waiting("r1", _run_row(client).wake_seq)
    assert _run_row(client).status == RunStatus.WAITING
    assert not client.runtime.ledger.set_waiting("r1", _run_row(client).wake_seq), (
        "waiting is not running"
    )
    client.runtime.ledger.resume_run("r1")
    seen = _run_row(client).wake_seq
    with client.runtime.db.begin() as conn:  # a signal's wake-up, after the replay read it
        conn.exec_driver_sql("UPDATE fleet_runs SET wake_seq = wake_seq + 1 WHERE id = 'r1'")
    assert not client.runtime.ledger.set_waiting("r1", seen), "woken since it was read"
    assert _run_row(client).status == RunStatus.RUNNING


def test_resume_run(client: Fleet) -> None:
    _run(client)
    assert not client.runtime.ledger.resume_run("r1"), "running is not waiting"
    assert client.runtime.ledger.set_waiting("r1", _run_row(client).wake_seq)
    assert client.runtime.ledger.resume_run("r1")
    assert _run_row(client).status == RunStatus.RUNNING


def test_succeed_run(client: Fleet) -> None:
    _run(client)
    ledger = client.runtime.ledger
    assert ledger.finish_run("r1", RunStatus.SUCCEEDED, result="42")
    run = _run_row(client)
    assert (run.status, run.result) == (RunStatus.SUCCEEDED, "42")
    assert run.finished_at is not None
    assert not ledger.finish_run("r1", RunStatus.FAILED, error="late"), "finished already"
    assert _run_row(client).status == RunStatus.SUCCEEDED


def test_fail_run(client: Fleet) -> None:
    _run(client)
    ledger = client.runtime.ledger
    assert ledger.set_waiting("r1", _run_row(client).wake_seq)
    assert not ledger.finish_run("r1", RunStatus.FAILED, error="x"), "waiting is not running"
    assert ledger.resume_run("r1")
    assert ledger.finish_run("r1", RunStatus.FAILED, error="boom")
    run = _run_row(client)
    assert (run.status, run.error) == (RunStatus.FAILED, "boom")


def test_cancel_run(client: Fleet) -> None:
    _run(client)
    ledger = client.runtime.ledger
    _force(client, runs, status=RunStatus.NEEDS_DECISION)
    assert ledger.cancel_run("r1", "no longer needed")
    run = _run_row(client)
    assert (run.status, run.error) == (RunStatus.CANCELLED, "cancelled: no longer needed")
    assert not ledger.cancel_run("r1", "twice"), "cancelled is not live"
    _force(client, runs, status=RunStatus.SUCCEEDED)
    assert not ledger.cancel_run("r1", "too late"), "succeeded is not live"
    assert _run_row(client).status == RunStatus.SUCCEEDED


def test_park_run_in_doubt(client: Fleet) -> None:
    _in_doubt(client)
    run = _run_row(client)
    assert (run.status, run.decision) == (RunStatus.NEEDS_DECISION, "effect")
    _force(client, runs, status=RunStatus.WAITING, decision=None)
    assert _rows(client, sql.PARK_RUN_IN_DOUBT, b_run="r1") == 0, "waiting is not running"
    assert _run_row(client).status == RunStatus.WAITING


def test_park_over_budget(client: Fleet) -> None:
    _run(client, budget_tokens=10)
    ledger = client.runtime.ledger
    lease = _lease(client)
    assert not ledger.park_over_budget("r1"), "nothing spent yet: within budget"
    ledger.add_usage("r1", STEP, lease.epoch, model="m", input_tokens=8, output_tokens=4, cost=0)
    _force(client, runs, status=RunStatus.WAITING)
    assert not ledger.park_over_budget("r1"), "over budget, but waiting is not running"
    _force(client, runs, status=RunStatus.RUNNING)
    assert ledger.park_over_budget("r1")
    run = _run_row(client)
    assert (run.status, run.decision) == (RunStatus.NEEDS_DECISION, "budget")


def test_resolve_run(client: Fleet) -> None:
    _in_doubt(client)
    assert client.runtime.ledger.resolve("r1", STEP, '"it happened"')
    run = _run_row(client)
    assert (run.status, run.decision) == (RunStatus.RUNNING, None)
    assert _rows(client, sql.RESOLVE_RUN, b_run="r1") == 0, "running is not needs_decision"


def test_raise_budget(client: Fleet) -> None:
    _run(client, budget_tokens=10)
    ledger = client.runtime.ledger
    assert not ledger.raise_budget("r1", 100, None), "running is not parked for budget"
    _force(client, runs, status=RunStatus.NEEDS_DECISION, decision="effect")
    assert not ledger.raise_budget("r1", 100, None), "parked for an effect, not for budget"
    _force(client, runs, decision="budget")
    assert ledger.raise_budget("r1", 100, None)
    run = _run_row(client)
    assert (run.status, run.decision, run.budget_tokens) == (RunStatus.RUNNING, None, 100)
    assert run.budget_cost is None, "a limit not given stays as it was"


def test_replay_run(client: Fleet) -> None:
    letter = _dead(client)
    ledger = client.runtime.ledger
    assert ledger.finish_run("r1", RunStatus.FAILED, error="dead")
    _force(client, runs, status=RunStatus.SUCCEEDED)
    assert ledger.replay_dead_letter(letter, None) is ReplayRefused.RUN_FINISHED
    assert _step_row(client).status == StepStatus.DEAD, "nothing written"
    _force(client, runs, status=RunStatus.FAILED)
    assert ledger.replay_dead_letter(letter, None) is None
    run = _run_row(client)
    assert (run.status, run.error, run.finished_at) == (RunStatus.RUNNING, None, None)


# --- steps --------------------------------------------------------------------------


def test_take_lease(client: Fleet) -> None:
    _run(client)
    lease = _lease(client)
    step = _step_row(client)
    assert (step.status, step.epoch, step.attempts) == (StepStatus.RUNNING, 1, 1)
    assert lease.epoch == 1
    _force(client, steps, status=StepStatus.DONE)
    assert client.runtime.ledger.take_lease("r1", STEP, "b", 30) is TakeRefused.ALREADY_FINISHED
    _force(client, steps, status=StepStatus.IN_DOUBT)
    assert client.runtime.ledger.take_lease("r1", STEP, "b", 30) is TakeRefused.NOT_DUE
    assert _step_row(client).epoch == 1, "nothing written"


def test_take_lease_as_for_a_run_without_limits_keeps_the_budget(client: Fleet) -> None:
    """``limited=False`` (the caller read the run has no limits) sums no spend; given
    for a run that has a budget, the statement refuses and the ledger takes it as for
    a run with limits, budget checked: no step of it starts over budget."""
    _run(client, budget_tokens=10)
    ledger = client.runtime.ledger
    lease = ledger.take_lease("r1", STEP, "a", 30, limited=False)
    assert isinstance(lease, Lease) and lease.epoch == 1, "taken, as for a run with limits"
    ledger.add_usage("r1", STEP, lease.epoch, model="m", input_tokens=8, output_tokens=4, cost=0)
    _force(client, steps, status=StepStatus.PENDING)
    assert ledger.take_lease("r1", STEP, "b", 30, limited=False) is TakeRefused.OVER_BUDGET
    with client.runtime.db.transaction() as tx:
        answer = ledger.within(tx).take_lease_at_commit("r1", STEP, "b", 30, limited=False)
    assert answer() is TakeRefused.OVER_BUDGET
    assert _step_row(client).epoch == 1, "nothing written"
    _run(client, "r2")
    unlimited = client.runtime.queries.run("r2")
    assert unlimited is not None and not unlimited.limited and _run_row(client).limited
    lease = ledger.take_lease("r2", STEP, "c", 30, limited=False)
    assert isinstance(lease, Lease) and lease.epoch == 1


def test_commit_output(client: Fleet) -> None:
    _run(client)
    ledger = client.runtime.ledger
    lease = _lease(client)
    _force(client, steps, status=StepStatus.PENDING)
    refused = ledger.commit_output("r1", STEP, lease.epoch, '"late"')
    assert isinstance(refused, Committed) and not refused, "pending is not running: fenced"
    assert client.runtime.queries.incident_counts("r1") == {"fenced_write": 1}
    _force(client, steps, status=StepStatus.RUNNING)
    assert ledger.commit_output("r1", STEP, lease.epoch, '"ok"')
    step = _step_row(client)
    assert (step.status, step.output) == (StepStatus.DONE, '"ok"')


def test_schedule_retry(client: Fleet) -> None:
    _run(client)
    ledger = client.runtime.ledger
    lease = _lease(client)
    assert ledger.schedule_retry("r1", STEP, lease.epoch, 60, "E: x", countdown=False)
    step = _step_row(client)
    assert (step.status, step.error) == (StepStatus.RETRY_WAIT, "E: x")
    assert step.due_at is not None and step.lease_owner is None
    assert not ledger.schedule_retry("r1", STEP, lease.epoch, 60, "E: y", countdown=False), (
        "retry_wait is not running: fenced"
    )
    assert _step_row(client).error == "E: x"


def test_dead_letter(client: Fleet) -> None:
    letter = _dead(client)
    assert _step_row(client).status == StepStatus.DEAD
    (row,) = client.runtime.queries.dead_letters("r1")
    assert (row.id, row.error_type, row.attempts) == (letter, "ValueError", 1)
    refused = client.runtime.ledger.dead_letter(
        "r1", STEP, epoch=1, workflow="chain", error_type="E", error_message="m", traceback=None
    )
    assert refused is None, "dead is not running: fenced"
    assert len(client.runtime.queries.dead_letters("r1")) == 1


def test_dead_letter_exhausted(client: Fleet) -> None:
    _run(client, max_attempts=1)
    ledger = client.runtime.ledger
    _force(client, steps, attempts=1, status=StepStatus.RETRY_WAIT, due_at=0.0)
    assert ledger.take_lease("r1", STEP, "w", 30) is TakeRefused.EXHAUSTED
    given: dict[str, Any] = {
        "workflow": "chain",
        "error_type": "AttemptsExhausted",
        "traceback": None,
    }
    _force(client, steps, status=StepStatus.IN_DOUBT)
    assert ledger.dead_letter("r1", STEP, epoch=None, error_message="x", **given) is None, (
        "in_doubt is not takeable: a person decides it"
    )
    _force(client, steps, status=StepStatus.RETRY_WAIT)
    assert ledger.dead_letter("r1", STEP, epoch=None, error_message="lost", **given)
    step = _step_row(client)
    assert (step.status, step.error) == (StepStatus.DEAD, "AttemptsExhausted: lost")


def test_park_in_doubt(client: Fleet) -> None:
    _run(client)
    ledger = client.runtime.ledger
    lease = _lease(client)
    assert ledger.schedule_retry("r1", STEP, lease.epoch, 60, "E: x", countdown=False)
    assert not ledger.park_in_doubt("r1", STEP, lease.epoch), "retry_wait is not running"
    assert _run_row(client).status == RunStatus.RUNNING, "nothing written"
    _force(client, steps, status=StepStatus.RUNNING)
    assert ledger.park_in_doubt("r1", STEP, lease.epoch)
    assert _step_row(client).status == StepStatus.IN_DOUBT
    assert client.runtime.queries.incident_counts("r1") == {"effect_in_doubt": 1}


def test_resolve_done(client: Fleet) -> None:
    _in_doubt(client)
    ledger = client.runtime.ledger
    assert ledger.resolve("r1", STEP, '"done by hand"')
    step = _step_row(client)
    assert (step.status, step.output) == (StepStatus.DONE, '"done by hand"')
    _force(client, runs, status=RunStatus.NEEDS_DECISION)
    assert not ledger.resolve("r1", STEP, '"again"'), "done is not in_doubt"
    assert _step_row(client).output == '"done by hand"'


def test_resolve_retry(client: Fleet) -> None:
    _in_doubt(client)
    ledger = client.runtime.ledger
    assert ledger.resolve("r1", STEP, None)
    step = _step_row(client)
    assert step.status == StepStatus.PENDING
    assert step.max_attempts > step.attempts, "one more attempt is allowed"
    _force(client, runs, status=RunStatus.NEEDS_DECISION)
    assert not ledger.resolve("r1", STEP, None), "pending is not in_doubt"


def test_replay_step(client: Fleet) -> None:
    letter = _dead(client)
    ledger = client.runtime.ledger
    _force(client, steps, status=StepStatus.DONE)
    assert ledger.replay_dead_letter(letter, None) is ReplayRefused.STEP_NOT_DEAD
    _force(client, steps, status=StepStatus.DEAD)
    assert ledger.replay_dead_letter(letter, '{"args":[2],"kwargs":{}}') is None
    step = _step_row(client)
    assert (step.status, step.attempts, step.error) == (StepStatus.PENDING, 0, None)
    assert step.input == '{"args":[2],"kwargs":{}}'
    assert ledger.replay_dead_letter(letter, None) is ReplayRefused.ALREADY_REPLAYED


def test_revoke_lease(client: Fleet) -> None:
    _run(client)
    ledger = client.runtime.ledger
    lease = _lease(client)
    _wait(client, "wait#1", "wait:go")
    assert ledger.cancel_run("r1", "stop")
    step = _step_row(client)
    assert (step.status, step.epoch, step.lease_owner) == (
        StepStatus.PENDING,
        lease.epoch + 1,
        None,
    )
    assert not ledger.heartbeat("r1", STEP, lease.epoch, 30), "the revoked lease is gone"
    wait = _step_row(client, "wait#1")
    assert (wait.status, wait.epoch) == (StepStatus.PENDING, 0), "pending is not running"


def test_deliver_signal(client: Fleet) -> None:
    _run(client)
    ledger = client.runtime.ledger
    _wait(client, "wait#1", "wait:go")
    _force(client, steps, step_id="wait#1", status=StepStatus.DONE)
    assert ledger.add_signal("r1", "go", '"early"') is not None
    assert ledger.deliver_signals("r1") == 0, "done is not pending"
    with client.runtime.db.begin() as conn:
        unconsumed = conn.execute(select(signals.c.id).where(signals.c.consumed_at.is_(None)))
        assert len(unconsumed.all()) == 1, "the signal stays for a later wait"
    _force(client, steps, step_id="wait#1", status=StepStatus.PENDING)
    assert ledger.deliver_signals("r1") == 1
    wait = _step_row(client, "wait#1")
    assert (wait.status, wait.output) == (StepStatus.DONE, '"early"')


def test_fire_due_wait(client: Fleet) -> None:
    _run(client)
    ledger = client.runtime.ledger
    _wait(client, "wait#1", "sleep", delay=0.0)
    _force(client, steps, step_id="wait#1", status=StepStatus.DONE, output='"signalled"')
    assert ledger.fire_due_waits() == [], "done is not pending"
    _force(client, steps, step_id="wait#1", status=StepStatus.PENDING)
    assert ledger.fire_due_waits() == [("r1", "q")]
    wait = _step_row(client, "wait#1")
    assert (wait.status, wait.output) == (StepStatus.DONE, "null")


def _children(client: Fleet, *names: str) -> None:
    """``r1`` running, with one pending child step per name and its queued child run."""
    _run(client)
    call = '{"args":[1],"kwargs":{}}'
    new = [
        NewStep(
            name,
            i,
            "chain",
            StepKind.CHILD,
            call,
            1,
            child=NewChild(f"r1/{name}", "chain", "1", "{}", call, "q"),
        )
        for i, name in enumerate(names, 1)
    ]
    client.runtime.ledger.record_steps("r1", new)
    for name in names:
        assert client.runtime.ledger.start_run(f"r1/{name}")


def test_settle_child_done(client: Fleet) -> None:
    _children(client, "a", "b")
    ledger = client.runtime.ledger
    child = client.runtime.queries.run("r1/a")
    assert child is not None and (child.parent_id, child.parent_step) == ("r1", "a")
    woken = _run_row(client).wake_seq
    assert ledger.finish_run("r1/a", RunStatus.SUCCEEDED, result="49")
    step = _step_row(client, "a")
    assert (step.status, step.output) == (StepStatus.DONE, "49")
    assert _run_row(client).wake_seq == woken + 1, "the parent is woken"
    _force(client, steps, step_id="b", status=StepStatus.DEAD, error="gone")
    assert ledger.finish_run("r1/b", RunStatus.SUCCEEDED, result="1")
    step = _step_row(client, "b")
    assert (step.status, step.output) == (StepStatus.DEAD, None), "dead is not pending"
    assert _run_row(client).wake_seq == woken + 1


def test_settle_child_dead(client: Fleet) -> None:
    _children(client, "a", "b", "c")
    ledger = client.runtime.ledger
    assert ledger.finish_run("r1/a", RunStatus.FAILED, error="StepFailed: boom\ntraceback")
    step = _step_row(client, "a")
    assert (step.status, step.error) == (StepStatus.DEAD, "child run r1/a failed: StepFailed: boom")
    assert ledger.cancel_run("r1/b", "not needed")
    step = _step_row(client, "b")
    assert (step.status, step.error) == (StepStatus.DEAD, "child run r1/b cancelled: not needed")
    _force(client, steps, step_id="c", status=StepStatus.DONE, output="1")
    assert ledger.cancel_run("r1/c", "late")
    step = _step_row(client, "c")
    assert (step.status, step.error) == (StepStatus.DONE, None), "done is not pending"


def test_every_transition_has_its_test() -> None:
    tests = {name for name in dir(sys.modules[__name__]) if name.startswith("test_")}
    missing = sorted(name for name in TRANSITIONS if f"test_{name}" not in tests)
    assert missing == []
