"""The derived writes: what a transition writes besides the status it changes, in
the same transaction (the attempt log, intents, incidents, a dead letter, a run's
wake-up). They are built once, at import, as the transitions are; none decides
anything: each runs only after the deciding statement in
``fleet/store/transitions.py`` has applied, or, for a fenced write, to record it.
"""

from __future__ import annotations

from sqlalchemy import Integer, String, bindparam, exists, func, insert, select
from sqlalchemy import update as _update
from sqlalchemy.dialects import postgresql, sqlite

from fleet.states import AttemptOutcome, IntentOutcome, StepKind
from fleet.store.predicates import (
    ATTEMPT,
    EPOCH,
    ERROR,
    GRACE,
    INPUT,
    NAME,
    OUTCOME,
    OWNER,
    RUN,
    STEP,
    among,
    held,
    now,
    takeable,
)
from fleet.store.schema import attempts, dead_letters, fanouts, incidents, intents, runs, steps

# Its takeable steps are re-sent by the sweeper after grace if the caller's send is lost.
REDISPATCH_TAKEABLE = (
    _update(steps)
    .where(steps.c.run_id == RUN, steps.c.kind == StepKind.TASK, takeable(now()))
    .values(redispatch_at=now() + GRACE, dispatches=0)
)

# --- a run's wake-up: the run needs replaying; the sweeper re-sends a lost advance ----
WAKE = (
    _update(runs)
    .where(runs.c.id == RUN)
    .values(
        wake_seq=runs.c.wake_seq + 1,
        updated_at=now(),
        redispatch_at=now() + GRACE,
        dispatches=0,
    )
)
# The same, handing back the updated run row (for a replay in the same transaction).
WAKE_RETURNING = WAKE.returning(*runs.c)

# --- a fan-out's settle count: the run is woken by its last branch to settle, not each --
# One row per fan-out (wf.map, wf.parallel), written with its branches (no-op on conflict:
# racing replays record the same fan-out).
RECORD_FANOUT = {
    name: dialect.insert(fanouts)
    .values(
        run_id=RUN,
        fanout=bindparam("b_fanout", type_=Integer),
        size=bindparam("b_size", type_=Integer),
        settled=bindparam("b_settled", type_=Integer),
    )
    .on_conflict_do_nothing()
    for name, dialect in (("postgresql", postgresql), ("sqlite", sqlite))
}
# The fan-out the step (b_run, b_step) is a branch of; NULL (no row matched): none.
_STEP_FANOUT = select(steps.c.fanout).where(steps.c.run_id == RUN, steps.c.step_id == STEP)
_BRANCH_OF = (fanouts.c.run_id == RUN, fanouts.c.fanout == _STEP_FANOUT.scalar_subquery())
# A branch settled (done or dead). The row lock this takes serialises the fan-out's
# branches settling at once (Postgres): exactly one of them sees ``settled == size``.
# ``SETTLE``: the count, for a statement that names the fan-out itself (fused.py).
SETTLE = (
    _update(fanouts)
    .values(settled=fanouts.c.settled + 1)
    .returning(fanouts.c.settled, fanouts.c.size)
)
SETTLE_BRANCH = SETTLE.where(*_BRANCH_OF)
# A branch goes back to not settled (its dead letter replayed: dead → pending).
UNSETTLE_BRANCH = _update(fanouts).where(*_BRANCH_OF).values(settled=fanouts.c.settled - 1)

# Zero rows: a later advance already recorded more (monotonic, so nothing is lost).
# Its own name for the seq: it shares a statement with a step's (fleet/store/fused.py).
ADVANCED = bindparam("b_advanced", type_=Integer)
MARK_ADVANCED = (
    _update(runs)
    .where(runs.c.id == RUN, runs.c.advanced_seq < ADVANCED)
    .values(advanced_seq=ADVANCED)
)

# The attempt that held the previous epoch, if it never reported, was lost.
MARK_LOST = (
    _update(attempts)
    .where(
        attempts.c.run_id == RUN,
        attempts.c.step_id == STEP,
        attempts.c.outcome == AttemptOutcome.RUNNING,
    )
    .values(outcome=AttemptOutcome.LOST, finished_at=now())
)

# What an attempt's row starts with besides whose it is and when it started: the
# plain insert below and the fused take (``fleet/store/fused.py``) both open it so.
ATTEMPT_STARTS: dict[str, object] = {
    "outcome": AttemptOutcome.RUNNING.value,
    "calls": 0,
    "input_tokens": 0,
    "output_tokens": 0,
    "cost": 0.0,
}
OPEN_ATTEMPT = insert(attempts).values(
    run_id=RUN,
    step_id=STEP,
    epoch=EPOCH,
    attempt=ATTEMPT,
    worker=OWNER,
    started_at=now(),
    **ATTEMPT_STARTS,
)

_FIRST_FAILED = (
    select(attempts.c.finished_at)
    .where(
        attempts.c.run_id == RUN,
        attempts.c.step_id == STEP,
        among(attempts.c.outcome, [AttemptOutcome.FAILED, AttemptOutcome.LOST]),
    )
    .order_by(attempts.c.epoch)
    .limit(1)
    .scalar_subquery()
)
FILE_DEAD_LETTER = (
    insert(dead_letters)
    .values(
        run_id=RUN,
        step_id=STEP,
        workflow=bindparam("b_workflow", type_=String),
        name=NAME,
        input=INPUT,
        error_type=bindparam("b_error_type", type_=String),
        error_message=bindparam("b_error_message", type_=String),
        traceback=bindparam("b_traceback", type_=String),
        attempts=ATTEMPT,
        first_failed_at=func.coalesce(_FIRST_FAILED, now()),
        last_failed_at=now(),
    )
    .returning(dead_letters.c.id)
)

# --- the attempt log: a still-open attempt is closed; one already marked lost by a
# takeover keeps "lost" unless it now reports itself fenced -------------------------
CLOSE_ATTEMPT = (
    _update(attempts)
    .where(
        attempts.c.run_id == RUN,
        attempts.c.step_id == STEP,
        attempts.c.epoch == EPOCH,
        among(attempts.c.outcome, [AttemptOutcome.RUNNING, AttemptOutcome.LOST]),
    )
    .values(outcome=OUTCOME, error=ERROR, finished_at=now())
)

# --- intents: write-ahead (only while the lease is held), then settled ---------------
WRITE_INTENT = (
    insert(intents)
    .from_select(
        ["run_id", "step_id", "epoch", "idempotency_key", "input_hash", "outcome", "created_at"],
        select(
            RUN,
            STEP,
            EPOCH,
            bindparam("b_key", type_=String),
            bindparam("b_input_hash", type_=String),
            bindparam("b_open", type_=String, value=IntentOutcome.OPEN.value),
            now(),
        ).where(exists().where(held(RUN, STEP, EPOCH))),
    )
    .returning(intents.c.epoch)
)
HELD = select(steps.c.epoch).where(held(RUN, STEP, EPOCH))

_OPEN_INTENTS = _update(intents).where(
    intents.c.run_id == RUN,
    intents.c.step_id == STEP,
    intents.c.outcome == IntentOutcome.OPEN,
)
_SETTLED = dict(outcome=OUTCOME, settled_at=now())
SETTLE_INTENT = _OPEN_INTENTS.where(intents.c.epoch == EPOCH).values(**_SETTLED)
SETTLE_INTENTS_BEFORE = _OPEN_INTENTS.where(intents.c.epoch < EPOCH).values(**_SETTLED)
SETTLE_ALL_INTENTS = _OPEN_INTENTS.values(**_SETTLED)

# --- incidents: counted fleet-wide, in the transaction that met them -----------------
INCIDENT = insert(incidents).values(
    kind=bindparam("b_kind", type_=String),
    run_id=RUN,
    step_id=STEP,
    epoch=EPOCH,
    worker=OWNER,
    detail=bindparam("b_detail", type_=String),
    at=now(),
)
