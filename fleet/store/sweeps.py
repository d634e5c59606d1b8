"""What the sweeper asks of the store, as statements: the steps and runs whose wake-up
went unanswered (claimed for a re-send, which pushes the next one out), the waits
whose time has come, and the kept signals whose pending wait no hand-over met. The
ledger's ``Upkeep`` runs them (``fleet/store/upkeep.py``); ``fleet/worker/sweeper.py``
acts on what they return.
"""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import String, exists, literal, or_
from sqlalchemy import select as _select
from sqlalchemy import update as _update

from fleet.states import TRANSITIONS, RunStatus, StepKind
from fleet.store import transitions as sql
from fleet.store.predicates import (
    GRACE,
    LIMIT,
    RUN,
    STEP,
    now,
    run_is,
    status_in,
    step_is,
    takeable,
)
from fleet.store.schema import runs, signals, steps

# --- the sweeper's claims: push the re-send time out (linear back-off) ---------------
# SKIP LOCKED (Postgres; SQLite locks the whole file anyway): a row another transaction
# holds, say a worker paused mid-commit, is passed over, not waited for, so one frozen
# worker cannot stall every run's re-sends.
_STALLED_STEP = (
    (steps.c.kind == StepKind.TASK)
    & takeable(now())
    & or_(steps.c.redispatch_at.is_(None), steps.c.redispatch_at <= now())
    & run_is(steps.c.run_id, RunStatus.RUNNING)
)
STALLED_STEPS = (
    _select(steps.c.run_id, steps.c.step_id)
    .where(_STALLED_STEP)
    .limit(LIMIT)
    .with_for_update(of=steps, skip_locked=True)
)
CLAIM_STEP = (
    _update(steps)
    .where(step_is(RUN, STEP), _STALLED_STEP)
    .values(
        redispatch_at=now() + GRACE * (steps.c.dispatches + 1),
        dispatches=steps.c.dispatches + 1,
    )
    .returning(steps.c.name, steps.c.status)
)


class Stalled(NamedTuple):
    """A step the sweeper claimed for a re-send. ``abandoned``: its lease expired while
    it ran (its worker died, froze or lost the store): the message that started it was
    taken by that worker, so none is queued for it; any other stalled step (pending,
    or due for a retry) most likely still has its message in line behind a backlog."""

    run_id: str
    step_id: str
    queue: str
    workflow: str
    name: str
    abandoned: bool


_STALLED_RUN = (
    runs.c.status.in_([RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING])
    & (runs.c.advanced_seq < runs.c.wake_seq)
    & or_(runs.c.redispatch_at.is_(None), runs.c.redispatch_at <= now())
)
STALLED_RUNS = _select(runs.c.id).where(_STALLED_RUN).limit(LIMIT).with_for_update(skip_locked=True)
CLAIM_RUN = (
    _update(runs)
    .where(runs.c.id == RUN, _STALLED_RUN)
    .values(
        redispatch_at=now() + GRACE * (runs.c.dispatches + 1),
        dispatches=runs.c.dispatches + 1,
    )
    .returning(runs.c.queue)
)
# A signal kept (not consumed) while a wait for it is pending in a live run: both
# hand-overs missed it (the sender's found no pending wait, the advance recording the
# wait found no signal, each before the other committed). The sweeper hands it over.
_PENDING_WAIT_FOR_IT = exists().where(
    steps.c.run_id == signals.c.run_id,
    steps.c.kind == StepKind.WAIT,
    steps.c.name == literal("wait:", String) + signals.c.name,
    status_in(TRANSITIONS["deliver_signal"]),
)
STRANDED_SIGNALS = (
    _select(runs.c.id, runs.c.queue)
    .where(
        runs.c.id.in_(
            _select(signals.c.run_id).where(signals.c.consumed_at.is_(None), _PENDING_WAIT_FOR_IT)
        ),
        runs.c.status.in_([RunStatus.RUNNING, RunStatus.WAITING]),
    )
    .limit(LIMIT)
)
DUE_WAITS = (
    _select(steps.c.run_id, steps.c.step_id)
    .where(sql.DUE_WAIT)
    .limit(LIMIT)
    .with_for_update(of=steps, skip_locked=True)
)
