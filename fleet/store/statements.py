"""The predicates every conditional write is built from, and the statements of a
step's hot path built once.

A step's transaction runs eight statements. Building each from the column
objects on every call costs SQLAlchemy more Python time than the database spends
on it; the prebuilt ones below take their values as bound parameters (``b_*``,
never a column's name, which SQLAlchemy reserves for SET values) and reuse one
compiled form. Only the ledger executes the writes.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    Float,
    Integer,
    String,
    and_,
    bindparam,
    exists,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from fleet.states import AttemptOutcome, RunStatus, StepKind, StepStatus
from fleet.store.engine import db_now
from fleet.store.schema import attempts, runs, steps


# A step whose lease may be taken now: never run, due for retry, or abandoned.
def takeable(now: Any) -> Any:
    return or_(
        steps.c.status == StepStatus.PENDING,
        and_(steps.c.status == StepStatus.RETRY_WAIT, steps.c.due_at <= now),
        and_(steps.c.status == StepStatus.RUNNING, steps.c.lease_expires_at < now),
    )


def run_is(run_id: Any, *statuses: RunStatus) -> Any:
    return exists().where(runs.c.id == run_id, runs.c.status.in_(list(statuses)))


def spent_tokens(run_id: Any) -> Any:
    return (
        select(func.coalesce(func.sum(attempts.c.input_tokens + attempts.c.output_tokens), 0))
        .where(attempts.c.run_id == run_id)
        .scalar_subquery()
    )


def spent_cost(run_id: Any) -> Any:
    return (
        select(func.coalesce(func.sum(attempts.c.cost), 0.0))
        .where(attempts.c.run_id == run_id)
        .scalar_subquery()
    )


def within_budget(run_id: Any) -> Any:
    """The run's recorded spend (every attempt's) is below each limit it has."""
    return exists().where(
        runs.c.id == run_id,
        or_(runs.c.budget_tokens.is_(None), spent_tokens(run_id) < runs.c.budget_tokens),
        or_(runs.c.budget_cost.is_(None), spent_cost(run_id) < runs.c.budget_cost),
    )


def step_is(run_id: Any, step_id: Any) -> Any:
    return and_(steps.c.run_id == run_id, steps.c.step_id == step_id)


def held(run_id: Any, step_id: Any, epoch: Any) -> Any:
    """The fence: the step is still running under the epoch this writer holds."""
    return and_(
        step_is(run_id, step_id), steps.c.status == StepStatus.RUNNING, steps.c.epoch == epoch
    )


# --- bound parameters -----------------------------------------------------------

RUN = bindparam("b_run", type_=String)
STEP = bindparam("b_step", type_=String)
EPOCH = bindparam("b_epoch", type_=Integer)
OWNER = bindparam("b_owner", type_=String)
LEASE = bindparam("b_lease", type_=Float)  # seconds from now
GRACE = bindparam("b_grace", type_=Float)  # seconds from now
SEQ = bindparam("b_seq", type_=Integer)
OUTPUT = bindparam("b_output", type_=String)
OUTCOME = bindparam("b_outcome", type_=String)
ERROR = bindparam("b_error", type_=String)
ATTEMPT = bindparam("b_attempt", type_=Integer)


def _now() -> Any:
    return db_now()


# --- reads ----------------------------------------------------------------------

RUN_ROW = select(runs).where(runs.c.id == RUN)
STEP_ROW = select(steps).where(step_is(RUN, STEP))
HISTORY = select(steps).where(steps.c.run_id == RUN).order_by(steps.c.seq)
# The history after the rows a process has cached (see fleet/store/history.py).
HISTORY_AFTER = HISTORY.where(steps.c.seq > SEQ)

# --- a step's attempt -----------------------------------------------------------

# pending | due retry | expired running → running, epoch+1 and attempts+1 in one
# write, only while the run is live, the attempt cap not spent and the budget not
# reached (checked in the same statement that starts the step: however many workers
# race, none starts a step once the budget is reached).
TAKE = (
    update(steps)
    .where(
        step_is(RUN, STEP),
        steps.c.kind == StepKind.TASK,
        steps.c.attempts < steps.c.max_attempts,
        takeable(_now()),
        run_is(RUN, RunStatus.RUNNING),
        within_budget(RUN),
    )
    .values(
        status=StepStatus.RUNNING,
        epoch=steps.c.epoch + 1,
        attempts=steps.c.attempts + 1,
        lease_owner=OWNER,
        lease_expires_at=_now() + LEASE,
        due_at=None,
        # An expired lease is the sweeper's cue; no other re-send is needed.
        redispatch_at=None,
        dispatches=0,
    )
    .returning(steps.c.epoch, steps.c.attempts, steps.c.name, steps.c.input)
)

OPEN_ATTEMPT = insert(attempts).values(
    run_id=RUN,
    step_id=STEP,
    epoch=EPOCH,
    attempt=ATTEMPT,
    worker=OWNER,
    outcome=AttemptOutcome.RUNNING,
    started_at=_now(),
    calls=0,
    input_tokens=0,
    output_tokens=0,
    cost=0.0,
)

# Only a still-open attempt is closed: one already marked lost by a takeover keeps
# "lost" unless it now reports itself fenced.
CLOSE_ATTEMPT = (
    update(attempts)
    .where(
        attempts.c.run_id == RUN,
        attempts.c.step_id == STEP,
        attempts.c.epoch == EPOCH,
        attempts.c.outcome.in_([AttemptOutcome.RUNNING, AttemptOutcome.LOST]),
    )
    .values(outcome=OUTCOME, error=ERROR, finished_at=_now())
)

RENEW = update(steps).where(held(RUN, STEP, EPOCH)).values(lease_expires_at=_now() + LEASE)

COMMIT = (
    update(steps)
    .where(held(RUN, STEP, EPOCH))
    .values(
        status=StepStatus.DONE,
        output=OUTPUT,
        error=None,
        lease_owner=None,
        lease_expires_at=None,
        redispatch_at=None,
        finished_at=_now(),
    )
)

# --- a run's wake-ups -----------------------------------------------------------

# The run needs replaying; the sweeper re-sends the advance if it is lost.
WAKE = (
    update(runs)
    .where(runs.c.id == RUN)
    .values(
        wake_seq=runs.c.wake_seq + 1,
        updated_at=_now(),
        redispatch_at=_now() + GRACE,
        dispatches=0,
    )
)

# The same, handing back the updated run row (for a replay in the same transaction).
WAKE_RETURNING = WAKE.returning(*runs.c)

MARK_ADVANCED = (
    update(runs).where(runs.c.id == RUN, runs.c.advanced_seq < SEQ).values(advanced_seq=SEQ)
)


# --- steps recorded by a replay -------------------------------------------------


def _record_step(dialect: Any) -> Any:
    """A step a replay reached, a no-op if a concurrent replay inserted it first. Its
    times are offsets from the database's clock, NULL for none (``now + NULL`` is NULL):
    ``b_redispatch_in`` (a task: the advance sends the wake-up itself, the sweeper
    steps in after grace), ``b_due_in`` (a timed wait) and ``b_finished_in`` (a value,
    recorded done)."""
    return (
        dialect.insert(steps)
        .values(
            run_id=RUN,
            step_id=STEP,
            seq=SEQ,
            name=bindparam("b_name", type_=String),
            kind=bindparam("b_kind", type_=String),
            input=bindparam("b_input", type_=String),
            status=bindparam("b_status", type_=String),
            output=OUTPUT,
            attempts=0,
            max_attempts=bindparam("b_max_attempts", type_=Integer),
            epoch=0,
            dispatches=0,
            created_at=_now(),
            redispatch_at=_now() + bindparam("b_redispatch_in", type_=Float),
            due_at=_now() + bindparam("b_due_in", type_=Float),
            finished_at=_now() + bindparam("b_finished_in", type_=Float),
        )
        .on_conflict_do_nothing()
    )


RECORD_STEP = {"postgresql": _record_step(postgresql), "sqlite": _record_step(sqlite)}
