"""The one writer. Every state change in fleet is a method here, and each is one
conditional statement (``UPDATE … WHERE status = :expected AND epoch = :held``, or an
insert that is a no-op on conflict) whose zero-rows case is handled and named.

Derived writes that must not be lost if the process dies right after the
transition (the attempt log, a run's wake-up counter, a dead letter) share its
transaction, so the store never holds half a transition.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import and_, case, delete, exists, insert, literal, not_, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from fleet.states import AttemptOutcome, Incident, IntentOutcome, RunStatus, StepKind, StepStatus
from fleet.store import pruning
from fleet.store import statements as hot
from fleet.store.engine import Database, db_now
from fleet.store.queries import Snapshot, read_snapshot
from fleet.store.schema import (
    attempts,
    blobs,
    dead_letters,
    dead_messages,
    incidents,
    intents,
    runs,
    signals,
    steps,
)
from fleet.store.statements import held, run_is, step_is, takeable, within_budget

log = logging.getLogger("fleet.ledger")


def _dialect(conn: Connection) -> Any:
    """The dialect module whose ``insert`` has ``on_conflict_do_*``."""
    return postgresql if conn.dialect.name == "postgresql" else sqlite


def _claimable(conn: Connection, columns: Sequence[Any], due: Any, limit: int) -> list[Any]:
    """The keys of up to ``limit`` rows the sweeper may claim, locked for its claim.

    SKIP LOCKED (Postgres; SQLite locks the whole file anyway): a row another transaction
    holds, say a worker paused mid-commit, is passed over, not waited for, so one frozen
    worker cannot stall every run's re-sends."""
    table = columns[0].table
    stmt = select(*columns).where(due).limit(limit).with_for_update(of=table, skip_locked=True)
    return list(conn.execute(stmt).all())


def _wake(conn: Connection, run_id: str, grace: float) -> None:
    """Note that the run needs replaying; the sweeper re-sends if the advance is lost."""
    conn.execute(hot.WAKE, {"b_run": run_id, "b_grace": grace})


def _mark_advanced(conn: Connection, run_id: str, seq: int) -> None:
    conn.execute(hot.MARK_ADVANCED, {"b_run": run_id, "b_seq": seq})


def _settle_intents(
    conn: Connection,
    run_id: str,
    step_id: str,
    outcome: IntentOutcome,
    *,
    epoch: int | None = None,
    before: int | None = None,
) -> None:
    """Close open intents of a step: the one of ``epoch``, those before ``before``, or all."""
    where = [
        intents.c.run_id == run_id,
        intents.c.step_id == step_id,
        intents.c.outcome == IntentOutcome.OPEN,
    ]
    if epoch is not None:
        where.append(intents.c.epoch == epoch)
    if before is not None:
        where.append(intents.c.epoch < before)
    conn.execute(update(intents).where(*where).values(outcome=outcome, settled_at=db_now()))


class TakeRefused(StrEnum):
    """Why a lease was not taken: the zero-rows cases of ``take_lease``, named."""

    UNKNOWN_STEP = "unknown_step"  # malformed or stale message
    ALREADY_FINISHED = "already_finished"  # duplicate delivery of a done/dead step
    LEASE_LIVE = "lease_live"  # duplicate delivery while another attempt runs
    NOT_DUE = "not_due"  # a retry woken early; the sweeper sends it when due
    RUN_NOT_LIVE = "run_not_live"  # the run was cancelled or has finished
    EXHAUSTED = "exhausted"  # the attempt cap was spent by crashed attempts
    OVER_BUDGET = "over_budget"  # the run's spend has reached its budget


class ReplayRefused(StrEnum):
    """Why a dead letter was not replayed: the zero-rows cases of ``replay_dead_letter``."""

    NOT_FOUND = "no such dead letter"
    ALREADY_REPLAYED = "already replayed"
    RUN_FINISHED = "its run has succeeded or was cancelled"
    STEP_NOT_DEAD = "its step is no longer dead"


@dataclass(frozen=True)
class Lease:
    run_id: str
    step_id: str
    epoch: int
    attempt: int
    name: str
    input: str
    took_over: bool


@dataclass(frozen=True)
class NewStep:
    step_id: str
    seq: int
    name: str
    kind: StepKind
    input: str
    max_attempts: int
    output: str | None = None
    delay: float | None = None  # wait steps: settle by themselves after this many seconds


@dataclass(frozen=True)
class Committed:
    """What ``commit_output`` did: true when the output was recorded (false: fenced).
    ``snapshot``, when asked for, is the run as the same transaction left it."""

    applied: bool
    snapshot: Snapshot | None = None

    def __bool__(self) -> bool:
        return self.applied


class _Rollback(Exception):
    """Undo a savepoint whose second write found the row already settled."""


_LIVE_RUN = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING, RunStatus.NEEDS_DECISION)


class Ledger:
    """Every write to the store. Methods return whether their transition applied."""

    def __init__(self, db: Database, grace: float = 5.0) -> None:
        self.db = db
        self.grace = grace

    # --- runs -----------------------------------------------------------------

    def create_run(
        self,
        run_id: str,
        workflow: str,
        version: str,
        pins: str,
        args: str,
        queue: str,
        budget_tokens: int | None = None,
        budget_cost: float | None = None,
    ) -> bool:
        """Insert a queued run; False when ``run_id`` exists already (enqueue is idempotent)."""
        now = db_now()
        with self.db.begin() as conn:
            stmt = (
                _dialect(conn)
                .insert(runs)
                .values(
                    id=run_id,
                    workflow=workflow,
                    version=version,
                    pins=pins,
                    args=args,
                    queue=queue,
                    status=RunStatus.QUEUED,
                    budget_tokens=budget_tokens,
                    budget_cost=budget_cost,
                    wake_seq=1,
                    advanced_seq=0,
                    dispatches=0,
                    redispatch_at=now + self.grace,
                    created_at=now,
                    updated_at=now,
                )
                .on_conflict_do_nothing()
                .returning(runs.c.id)
            )
            # RETURNING, not rowcount: drivers disagree on rowcount for a skipped insert.
            return conn.execute(stmt).first() is not None

    def start_run(self, run_id: str) -> bool:
        """queued → running. False: another advance started it first (harmless)."""
        with self.db.begin() as conn:
            return (
                conn.execute(
                    update(runs)
                    .where(runs.c.id == run_id, runs.c.status == RunStatus.QUEUED)
                    .values(status=RunStatus.RUNNING, updated_at=db_now())
                ).rowcount
                == 1
            )

    def finish_run(
        self, run_id: str, status: RunStatus, *, result: str | None = None, error: str | None = None
    ) -> bool:
        """running → succeeded | failed. False: a concurrent advance finished it first,
        or it was cancelled meanwhile (both mean: nothing to do)."""
        assert status in (RunStatus.SUCCEEDED, RunStatus.FAILED)
        with self.db.begin() as conn:
            return (
                conn.execute(
                    update(runs)
                    .where(runs.c.id == run_id, runs.c.status == RunStatus.RUNNING)
                    .values(
                        status=status,
                        result=result,
                        error=error,
                        finished_at=db_now(),
                        updated_at=db_now(),
                    )
                ).rowcount
                == 1
            )

    def cancel_run(self, run_id: str, reason: str) -> bool:
        """Any live state → cancelled. Leases of running steps are revoked in the same
        transaction (epoch+1), so their commits are fenced and their heartbeats fail;
        no step of a cancelled run can take a lease, and no advance replays it."""
        now = db_now()
        with self.db.begin() as conn:
            cancelled = conn.execute(
                update(runs)
                .where(runs.c.id == run_id, runs.c.status.in_(list(_LIVE_RUN)))
                .values(
                    status=RunStatus.CANCELLED,
                    error=f"cancelled: {reason}",
                    finished_at=now,
                    updated_at=now,
                )
            ).rowcount
            if cancelled != 1:
                return False
            conn.execute(
                update(steps)
                .where(steps.c.run_id == run_id, steps.c.status == StepStatus.RUNNING)
                .values(
                    status=StepStatus.PENDING,
                    epoch=steps.c.epoch + 1,
                    lease_owner=None,
                    lease_expires_at=None,
                )
            )
            return True

    def set_waiting(self, run_id: str) -> bool:
        """running → waiting: the replay stopped at a wait and no worker is held."""
        return self._move_run(run_id, RunStatus.RUNNING, RunStatus.WAITING)

    def resume_run(self, run_id: str) -> bool:
        """waiting → running, before a replay acts on a signal or a timer."""
        return self._move_run(run_id, RunStatus.WAITING, RunStatus.RUNNING)

    def _move_run(self, run_id: str, expected: RunStatus, new: RunStatus) -> bool:
        with self.db.begin() as conn:
            return (
                conn.execute(
                    update(runs)
                    .where(runs.c.id == run_id, runs.c.status == expected)
                    .values(status=new, updated_at=db_now())
                ).rowcount
                == 1
            )

    # --- signals and timers -------------------------------------------------------

    def add_signal(self, run_id: str, name: str, payload: str) -> int | None:
        """Keep a signal for the run's waits; None if the run is not live (anymore)."""
        now = db_now()
        with self.db.begin() as conn:
            row = conn.execute(
                insert(signals)
                .from_select(
                    ["run_id", "name", "payload", "created_at"],
                    select(literal(run_id), literal(name), literal(payload), now).where(
                        run_is(run_id, *_LIVE_RUN)
                    ),
                )
                .returning(signals.c.id)
            ).first()
            return None if row is None else int(row[0])

    def deliver_signals(self, run_id: str) -> int:
        """Hand each pending wait of the run the oldest unconsumed signal of its name,
        earliest wait first, so two signals of one name are consumed in order. Each
        hand-over is two conditional writes in one savepoint: the signal is consumed
        only if the wait was still pending. Returns how many waits were settled."""
        now = db_now()
        delivered = 0
        with self.db.begin() as conn:
            waits = conn.execute(
                select(steps.c.step_id, steps.c.name)
                .where(
                    steps.c.run_id == run_id,
                    steps.c.kind == StepKind.WAIT,
                    steps.c.status == StepStatus.PENDING,
                    steps.c.name.like("wait:%"),
                )
                .order_by(steps.c.seq)
            ).all()
            for step_id, wait_name in waits:
                signal = conn.execute(
                    select(signals.c.id, signals.c.payload)
                    .where(
                        signals.c.run_id == run_id,
                        signals.c.name == wait_name[len("wait:") :],
                        signals.c.consumed_at.is_(None),
                    )
                    .order_by(signals.c.id)
                    .limit(1)
                ).first()
                if signal is None:
                    continue
                try:
                    with conn.begin_nested():
                        if not conn.execute(
                            update(signals)
                            .where(signals.c.id == signal.id, signals.c.consumed_at.is_(None))
                            .values(consumed_by=step_id, consumed_at=now)
                        ).rowcount:
                            raise _Rollback
                        if not conn.execute(
                            update(steps)
                            .where(step_is(run_id, step_id), steps.c.status == StepStatus.PENDING)
                            .values(status=StepStatus.DONE, output=signal.payload, finished_at=now)
                        ).rowcount:
                            raise _Rollback
                except _Rollback:
                    continue  # a concurrent delivery or the timeout got there first
                delivered += 1
            if delivered:
                _wake(conn, run_id, self.grace)
        return delivered

    def fire_due_waits(self, limit: int = 500) -> list[tuple[str, str]]:
        """Settle waits and sleeps whose due time has come (a wait's timeout returns
        None) and wake their runs. Returns (run_id, queue) of each woken run."""
        now = db_now()
        due = and_(
            steps.c.kind == StepKind.WAIT,
            steps.c.status == StepStatus.PENDING,
            steps.c.due_at <= now,
            run_is(steps.c.run_id, RunStatus.RUNNING, RunStatus.WAITING),
        )
        with self.db.begin() as conn:
            keys = _claimable(conn, (steps.c.run_id, steps.c.step_id), due, limit)
            woken: dict[str, str] = {}
            for run_id, step_id in keys:
                if conn.execute(
                    update(steps)
                    .where(step_is(run_id, step_id), due)
                    .values(status=StepStatus.DONE, output="null", finished_at=now)
                ).rowcount:
                    _wake(conn, run_id, self.grace)
                    woken[run_id] = conn.execute(
                        select(runs.c.queue).where(runs.c.id == run_id)
                    ).scalar_one()
            return list(woken.items())

    def mark_advanced(self, run_id: str, seq: int) -> None:
        """Record that a replay has seen every wake-up up to ``seq``. Zero rows: a later
        advance already recorded more (monotonic, so nothing is lost)."""
        with self.db.begin() as conn:
            _mark_advanced(conn, run_id, seq)

    # --- steps: recorded by replay --------------------------------------------

    def record_steps(
        self, run_id: str, new: Sequence[NewStep], advanced_seq: int | None = None
    ) -> None:
        """Insert steps the replay reached; a no-op for any a concurrent replay inserted.
        Step ids and positions are deterministic, so both replays insert the same rows.
        With ``advanced_seq``, this is the replay's last write: ``mark_advanced`` is done
        in the same transaction."""
        rows = [
            {
                "b_run": run_id,
                "b_step": s.step_id,
                "b_seq": s.seq,
                "b_name": s.name,
                "b_kind": s.kind,
                "b_input": s.input,
                "b_status": StepStatus.DONE if s.kind == StepKind.VALUE else StepStatus.PENDING,
                "b_output": s.output,
                "b_max_attempts": s.max_attempts,
                "b_redispatch_in": self.grace if s.kind == StepKind.TASK else None,
                "b_due_in": s.delay,
                "b_finished_in": 0.0 if s.kind == StepKind.VALUE else None,
            }
            for s in new
        ]
        with self.db.begin() as conn:
            if rows:
                # One prebuilt statement; several rows (a fan-out) go as one executemany.
                conn.execute(hot.RECORD_STEP[conn.dialect.name], rows)
            if advanced_seq is not None:
                _mark_advanced(conn, run_id, advanced_seq)

    # --- steps: one attempt ---------------------------------------------------

    def take_lease(
        self, run_id: str, step_id: str, owner: str, lease_seconds: float
    ) -> Lease | TakeRefused:
        """pending | due retry | expired running → running, epoch+1 and attempts+1 in one
        write, only while the run is live and the attempt cap is not spent."""
        now = db_now()
        with self.db.begin() as conn:
            row = conn.execute(
                hot.TAKE,
                {"b_run": run_id, "b_step": step_id, "b_owner": owner, "b_lease": lease_seconds},
            ).first()
            if row is None:
                return self._why_not_taken(conn, run_id, step_id)
            epoch, attempt, name, input_ = row
            # The attempt that held the previous epoch, if it never reported, was lost.
            # (Epochs only grow, so a first epoch has no earlier attempt to look for.)
            took_over = epoch > 1 and (
                conn.execute(
                    update(attempts)
                    .where(
                        attempts.c.run_id == run_id,
                        attempts.c.step_id == step_id,
                        attempts.c.outcome == AttemptOutcome.RUNNING,
                    )
                    .values(outcome=AttemptOutcome.LOST, finished_at=now)
                ).rowcount
                > 0
            )
            conn.execute(
                hot.OPEN_ATTEMPT,
                {
                    "b_run": run_id,
                    "b_step": step_id,
                    "b_epoch": epoch,
                    "b_attempt": attempt,
                    "b_owner": owner,
                },
            )
            if took_over:
                self._incident(conn, Incident.TAKEOVER, run_id, step_id, epoch, owner)
            return Lease(run_id, step_id, epoch, attempt, name, input_, took_over)

    def _why_not_taken(self, conn: Connection, run_id: str, step_id: str) -> TakeRefused:
        now = db_now()
        row = conn.execute(
            select(
                steps.c.status,
                steps.c.attempts,
                steps.c.max_attempts,
                takeable(now).label("takeable"),
                run_is(run_id, RunStatus.RUNNING).label("run_live"),
                within_budget(run_id).label("within_budget"),
            ).where(step_is(run_id, step_id))
        ).first()
        if row is None:
            return TakeRefused.UNKNOWN_STEP
        if StepStatus(row.status).finished:
            return TakeRefused.ALREADY_FINISHED
        if not row.run_live:
            return TakeRefused.RUN_NOT_LIVE
        if row.takeable and row.attempts >= row.max_attempts:
            return TakeRefused.EXHAUSTED
        if row.takeable and not row.within_budget:
            return TakeRefused.OVER_BUDGET
        if row.status == StepStatus.RUNNING:
            return TakeRefused.LEASE_LIVE
        return TakeRefused.NOT_DUE

    def heartbeat(self, run_id: str, step_id: str, epoch: int, lease_seconds: float) -> bool:
        """Extend a held lease. False: the lease was lost (taken over or revoked)."""
        with self.db.begin() as conn:
            params = {"b_run": run_id, "b_step": step_id, "b_epoch": epoch}
            return conn.execute(hot.RENEW, {**params, "b_lease": lease_seconds}).rowcount == 1

    def release_lease(self, run_id: str, step_id: str, epoch: int) -> bool:
        """A worker shutting down gives a held lease up: it expires now. False: it was
        not held any more (taken over, revoked, or the step finished)."""
        with self.db.begin() as conn:
            return (
                conn.execute(
                    update(steps)
                    .where(held(run_id, step_id, epoch))
                    .values(lease_expires_at=db_now() - 0.001, redispatch_at=None)
                ).rowcount
                == 1
            )

    def commit_output(
        self,
        run_id: str,
        step_id: str,
        epoch: int,
        output: str,
        *,
        earlier_intents: IntentOutcome | None = None,
        effect: bool = True,
        snapshot: bool = False,
    ) -> Committed:
        """running → done, only under the epoch held. False is a fenced write: the lease
        was taken over (or revoked) since this attempt took it. Counted, never applied.
        ``effect``: the step is an effect, whose intents settle with the commit (no
        other step writes intents). With ``snapshot``, an applied commit also reads the
        run and its history for the replay that follows (one transaction instead of two)."""
        with self.db.begin() as conn:
            params = {"b_run": run_id, "b_step": step_id, "b_epoch": epoch, "b_output": output}
            applied = conn.execute(hot.COMMIT, params).rowcount == 1
            self._close_attempt(
                conn,
                run_id,
                step_id,
                epoch,
                AttemptOutcome.DONE if applied else AttemptOutcome.FENCED,
            )
            if applied:
                # An effect's outcome commits with its checkpoint (and with ``earlier_intents``
                # set, the in-doubt intents of earlier attempts are settled with it).
                if effect:
                    _settle_intents(conn, run_id, step_id, IntentOutcome.DONE, epoch=epoch)
                if earlier_intents is not None:
                    _settle_intents(conn, run_id, step_id, earlier_intents, before=epoch)
                if snapshot:
                    # The wake-up returns the run row the replay needs: one read fewer.
                    run = conn.execute(hot.WAKE_RETURNING, {"b_run": run_id, "b_grace": self.grace})
                    snap = read_snapshot(conn, run_id, self.db.history, run=run.first())
                    return Committed(True, snap)
                _wake(conn, run_id, self.grace)
            else:
                self._incident(conn, Incident.FENCED_WRITE, run_id, step_id, epoch, None)
            return Committed(applied)

    def schedule_retry(
        self, run_id: str, step_id: str, epoch: int, delay: float, error: str, *, countdown: bool
    ) -> bool:
        """running → retry_wait with its due time in the store. False: fenced.
        With ``countdown`` the caller sends a delayed message itself, so the sweeper
        waits one grace period past the due time before it re-sends."""
        now = db_now()
        due = now + delay
        with self.db.begin() as conn:
            applied = (
                conn.execute(
                    update(steps)
                    .where(held(run_id, step_id, epoch))
                    .values(
                        status=StepStatus.RETRY_WAIT,
                        due_at=due,
                        error=error,
                        lease_owner=None,
                        lease_expires_at=None,
                        redispatch_at=due + self.grace if countdown else due,
                        dispatches=0,
                    )
                ).rowcount
                == 1
            )
            if applied:  # the step raised: it reports that its effect did not happen
                _settle_intents(conn, run_id, step_id, IntentOutcome.FAILED, epoch=epoch)
            self._close_attempt(
                conn,
                run_id,
                step_id,
                epoch,
                AttemptOutcome.FAILED if applied else AttemptOutcome.FENCED,
                error,
            )
            if not applied:
                self._incident(conn, Incident.FENCED_WRITE, run_id, step_id, epoch, None)
            return applied

    def dead_letter(
        self,
        run_id: str,
        step_id: str,
        *,
        epoch: int | None,
        workflow: str,
        error_type: str,
        error_message: str,
        traceback: str | None,
    ) -> int | None:
        """running → dead (``epoch`` held), or, with ``epoch=None``, a step whose cap was
        spent by attempts that crashed: pending | due retry | expired running → dead.
        The dead letter and the run's wake-up commit with it. Returns the dead letter's
        id; None when fenced or raced (another writer settled the step first)."""
        now = db_now()
        if epoch is None:
            guard = and_(
                step_is(run_id, step_id),
                steps.c.attempts >= steps.c.max_attempts,
                takeable(now),
                run_is(run_id, RunStatus.RUNNING),
            )
        else:
            guard = held(run_id, step_id, epoch)
        error = f"{error_type}: {error_message}"
        with self.db.begin() as conn:
            row = conn.execute(
                update(steps)
                .where(guard)
                .values(
                    status=StepStatus.DEAD,
                    error=error,
                    lease_owner=None,
                    lease_expires_at=None,
                    redispatch_at=None,
                    due_at=None,
                    finished_at=now,
                )
                .returning(steps.c.name, steps.c.input, steps.c.attempts, steps.c.created_at)
            ).first()
            if epoch is not None:
                self._close_attempt(
                    conn,
                    run_id,
                    step_id,
                    epoch,
                    AttemptOutcome.FAILED if row else AttemptOutcome.FENCED,
                    error,
                )
            if row is None:
                if epoch is not None:
                    self._incident(conn, Incident.FENCED_WRITE, run_id, step_id, epoch, None)
                return None
            if epoch is not None:
                _settle_intents(conn, run_id, step_id, IntentOutcome.FAILED, epoch=epoch)
            first_failed = conn.execute(
                select(attempts.c.finished_at)
                .where(
                    attempts.c.run_id == run_id,
                    attempts.c.step_id == step_id,
                    attempts.c.outcome.in_([AttemptOutcome.FAILED, AttemptOutcome.LOST]),
                )
                .order_by(attempts.c.epoch)
                .limit(1)
            ).scalar()
            letter_id = conn.execute(
                insert(dead_letters)
                .values(
                    run_id=run_id,
                    step_id=step_id,
                    workflow=workflow,
                    name=row.name,
                    input=row.input,
                    error_type=error_type,
                    error_message=error_message,
                    traceback=traceback,
                    attempts=row.attempts,
                    first_failed_at=first_failed if first_failed is not None else now,
                    last_failed_at=now,
                )
                .returning(dead_letters.c.id)
            ).scalar_one()
            _wake(conn, run_id, self.grace)
            return int(letter_id)

    def replay_dead_letter(self, letter_id: int, new_input: str | None) -> ReplayRefused | None:
        """A dead letter replayed: the letter is marked (kept, not deleted), the step goes
        dead → pending with a fresh attempt budget (its epoch keeps counting up, so no
        old lease can match again), and a failed run goes back to running. None on
        success; otherwise why not, with nothing written.

        The first statement decides, re-checking the step and the run inside its WHERE
        clause; the two after it cannot miss, as only a replay moves a step out of dead.
        """
        now = db_now()
        letter_step = and_(
            steps.c.run_id == dead_letters.c.run_id, steps.c.step_id == dead_letters.c.step_id
        )
        with self.db.begin() as conn:
            letter = conn.execute(
                update(dead_letters)
                .where(
                    dead_letters.c.id == letter_id,
                    dead_letters.c.replayed_at.is_(None),
                    exists().where(letter_step, steps.c.status == StepStatus.DEAD),
                    run_is(dead_letters.c.run_id, RunStatus.FAILED, RunStatus.RUNNING),
                )
                .values(replayed_at=now)
                .returning(dead_letters.c.run_id, dead_letters.c.step_id)
            ).first()
            if letter is None:
                return self._why_not_replayed(conn, letter_id)
            run_id, step_id = letter
            values: dict[str, Any] = {
                "status": StepStatus.PENDING,
                "attempts": 0,
                "error": None,
                "finished_at": None,
                "redispatch_at": now + self.grace,
                "dispatches": 0,
            }
            if new_input is not None:
                values["input"] = new_input
            conn.execute(
                update(steps)
                .where(step_is(run_id, step_id), steps.c.status == StepStatus.DEAD)
                .values(**values)
            )
            conn.execute(
                update(runs)
                .where(
                    runs.c.id == run_id, runs.c.status.in_([RunStatus.FAILED, RunStatus.RUNNING])
                )
                .values(
                    status=RunStatus.RUNNING,
                    error=None,
                    result=None,
                    finished_at=None,
                    updated_at=now,
                )
            )
            return None

    def _why_not_replayed(self, conn: Connection, letter_id: int) -> ReplayRefused:
        row = conn.execute(
            select(dead_letters.c.replayed_at, steps.c.status.label("step_status"))
            .select_from(
                dead_letters.join(
                    steps,
                    and_(
                        steps.c.run_id == dead_letters.c.run_id,
                        steps.c.step_id == dead_letters.c.step_id,
                    ),
                )
            )
            .where(dead_letters.c.id == letter_id)
        ).first()
        if row is None:
            return ReplayRefused.NOT_FOUND
        if row.replayed_at is not None:
            return ReplayRefused.ALREADY_REPLAYED
        if row.step_status != StepStatus.DEAD:
            return ReplayRefused.STEP_NOT_DEAD
        return ReplayRefused.RUN_FINISHED

    # --- effects ------------------------------------------------------------------------

    def write_intent(
        self, run_id: str, step_id: str, epoch: int, key: str, input_hash: str
    ) -> bool:
        """The write-ahead intent, committed before an effect's body runs, only while the
        lease is held. False: the lease was lost; the body must not run."""
        now = db_now()
        with self.db.begin() as conn:
            row = conn.execute(
                insert(intents)
                .from_select(
                    [
                        "run_id",
                        "step_id",
                        "epoch",
                        "idempotency_key",
                        "input_hash",
                        "outcome",
                        "created_at",
                    ],
                    select(
                        literal(run_id),
                        literal(step_id),
                        literal(epoch),
                        literal(key),
                        literal(input_hash),
                        literal(IntentOutcome.OPEN.value),
                        now,
                    ).where(exists().where(held(run_id, step_id, epoch))),
                )
                .returning(intents.c.epoch)
            ).first()
            return row is not None

    def supersede_intents(self, run_id: str, step_id: str, epoch: int) -> bool:
        """Earlier in-doubt intents will be retried under this epoch's key (an idempotent
        effect, or its reconcile hook said it had not happened). False: lease lost."""
        with self.db.begin() as conn:
            if not conn.execute(select(steps.c.epoch).where(held(run_id, step_id, epoch))).first():
                return False
            _settle_intents(conn, run_id, step_id, IntentOutcome.SUPERSEDED, before=epoch)
            return True

    def park_in_doubt(self, run_id: str, step_id: str, epoch: int) -> bool:
        """running → in_doubt and run running → needs_decision: an earlier attempt may
        have acted, the step cannot ask the world, and retrying would be a guess."""
        now = db_now()
        with self.db.begin() as conn:
            if not conn.execute(
                update(steps)
                .where(held(run_id, step_id, epoch))
                .values(
                    status=StepStatus.IN_DOUBT,
                    lease_owner=None,
                    lease_expires_at=None,
                    redispatch_at=None,
                )
            ).rowcount:
                return False
            self._close_attempt(
                conn,
                run_id,
                step_id,
                epoch,
                AttemptOutcome.FAILED,
                "an earlier attempt may have acted: needs a decision",
            )
            conn.execute(
                update(runs)
                .where(runs.c.id == run_id, runs.c.status == RunStatus.RUNNING)
                .values(status=RunStatus.NEEDS_DECISION, decision="effect", updated_at=now)
            )
            self._incident(conn, Incident.EFFECT_IN_DOUBT, run_id, step_id, epoch, None)
            return True

    def resolve(self, run_id: str, step_id: str, output: str | None) -> bool:
        """A person settles an in-doubt effect: with ``output`` it happened (in_doubt →
        done), without it it is to be retried (in_doubt → pending, with one more attempt
        allowed). The run goes back to running. False: the step was not in doubt."""
        now = db_now()
        if output is not None:
            values: dict[str, Any] = {
                "status": StepStatus.DONE,
                "output": output,
                "finished_at": now,
            }
            settled = IntentOutcome.RESOLVED
        else:
            values = {
                "status": StepStatus.PENDING,
                "max_attempts": case(
                    (steps.c.max_attempts > steps.c.attempts, steps.c.max_attempts),
                    else_=steps.c.attempts + 1,
                ),
                "redispatch_at": now + self.grace,
                "dispatches": 0,
            }
            settled = IntentOutcome.SUPERSEDED
        with self.db.begin() as conn:
            if not conn.execute(
                update(steps)
                .where(
                    step_is(run_id, step_id),
                    steps.c.status == StepStatus.IN_DOUBT,
                    run_is(run_id, RunStatus.NEEDS_DECISION),
                )
                .values(**values)
            ).rowcount:
                return False
            _settle_intents(conn, run_id, step_id, settled)
            conn.execute(
                update(runs)
                .where(runs.c.id == run_id, runs.c.status == RunStatus.NEEDS_DECISION)
                .values(status=RunStatus.RUNNING, decision=None, updated_at=now)
            )
            _wake(conn, run_id, self.grace)
            return True

    def park_over_budget(self, run_id: str) -> bool:
        """running → needs_decision ("budget"), re-checking in the same statement that
        the recorded spend has reached the budget. False: not (or no longer) over it."""
        with self.db.begin() as conn:
            return bool(
                conn.execute(
                    update(runs)
                    .where(
                        runs.c.id == run_id,
                        runs.c.status == RunStatus.RUNNING,
                        ~within_budget(run_id),
                    )
                    .values(status=RunStatus.NEEDS_DECISION, decision="budget", updated_at=db_now())
                ).rowcount
            )

    def raise_budget(self, run_id: str, tokens: int | None, cost: float | None) -> bool:
        """needs_decision ("budget") → running with new limits. The caller sends the run's
        takeable steps; the sweeper re-sends them after grace if that is lost. False: the
        run was not parked for budget."""
        now = db_now()
        values: dict[str, Any] = {"status": RunStatus.RUNNING, "decision": None, "updated_at": now}
        if tokens is not None:
            values["budget_tokens"] = tokens
        if cost is not None:
            values["budget_cost"] = cost
        with self.db.begin() as conn:
            if not conn.execute(
                update(runs)
                .where(
                    runs.c.id == run_id,
                    runs.c.status == RunStatus.NEEDS_DECISION,
                    runs.c.decision == "budget",
                )
                .values(**values)
            ).rowcount:
                return False
            conn.execute(
                update(steps)
                .where(steps.c.run_id == run_id, steps.c.kind == StepKind.TASK, takeable(now))
                .values(redispatch_at=now + self.grace, dispatches=0)
            )
            return True

    def put_blob(self, digest: str, body: str) -> None:
        """Store a large value once. If the same content is there already, only its
        ``created_at`` moves to now: retention never deletes a blob stored (or stored
        again) within its grace period, so a writer that is about to reference it is safe
        (see ``prune_blobs``)."""
        with self.db.begin() as conn:
            stmt = (
                _dialect(conn)
                .insert(blobs)
                .values(digest=digest, size=len(body.encode()), body=body, created_at=db_now())
            )
            conn.execute(
                stmt.on_conflict_do_update(
                    index_elements=[blobs.c.digest], set_={"created_at": db_now()}
                )
            )

    def add_usage(
        self,
        run_id: str,
        step_id: str,
        epoch: int,
        *,
        model: str | None,
        input_tokens: int,
        output_tokens: int,
        cost: float,
    ) -> None:
        """Add spend to the attempt that spent it, fenced or not: it was really spent."""
        values: dict[str, Any] = {
            "calls": attempts.c.calls + 1,
            "input_tokens": attempts.c.input_tokens + input_tokens,
            "output_tokens": attempts.c.output_tokens + output_tokens,
            "cost": attempts.c.cost + cost,
        }
        if model:
            values["model"] = model
        with self.db.begin() as conn:
            conn.execute(
                update(attempts)
                .where(
                    attempts.c.run_id == run_id,
                    attempts.c.step_id == step_id,
                    attempts.c.epoch == epoch,
                )
                .values(**values)
            )

    def _close_attempt(
        self,
        conn: Connection,
        run_id: str,
        step_id: str,
        epoch: int,
        outcome: AttemptOutcome,
        error: str | None = None,
    ) -> None:
        # Only a still-open attempt is closed: one already marked lost by a takeover
        # keeps "lost" unless it now reports itself fenced.
        conn.execute(
            hot.CLOSE_ATTEMPT,
            {
                "b_run": run_id,
                "b_step": step_id,
                "b_epoch": epoch,
                "b_outcome": outcome,
                "b_error": error,
            },
        )

    # --- the sweeper's claims -------------------------------------------------

    def claim_stalled_steps(self, limit: int = 500) -> list[tuple[str, str, str, str, str]]:
        """Steps that need an execute message the store has no sign was answered:
        takeable now and past their re-send time. Claiming pushes the re-send time
        out (linear back-off), so concurrent sweepers and a long backlog do not
        multiply messages. Returns (run_id, step_id, queue, workflow, step name)."""
        now = db_now()
        due = and_(
            steps.c.kind == StepKind.TASK,
            takeable(now),
            or_(steps.c.redispatch_at.is_(None), steps.c.redispatch_at <= now),
            run_is(steps.c.run_id, RunStatus.RUNNING),
        )
        with self.db.begin() as conn:
            keys = _claimable(conn, (steps.c.run_id, steps.c.step_id), due, limit)
            claimed: list[tuple[str, str, str, str, str]] = []
            for run_id, step_id in keys:
                row = conn.execute(
                    update(steps)
                    .where(step_is(run_id, step_id), due)
                    .values(
                        redispatch_at=now + self.grace * (steps.c.dispatches + 1),
                        dispatches=steps.c.dispatches + 1,
                    )
                    .returning(steps.c.name)
                ).first()
                if row is not None:
                    queue, workflow = conn.execute(
                        select(runs.c.queue, runs.c.workflow).where(runs.c.id == run_id)
                    ).one()
                    claimed.append((run_id, step_id, queue, workflow, row.name))
            return claimed

    def claim_stalled_runs(self, limit: int = 500) -> list[tuple[str, str]]:
        """Runs with a wake-up no replay has answered (a lost advance message), past
        their re-send time. Returns (run_id, queue)."""
        now = db_now()
        due = and_(
            runs.c.status.in_([RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING]),
            runs.c.advanced_seq < runs.c.wake_seq,
            or_(runs.c.redispatch_at.is_(None), runs.c.redispatch_at <= now),
        )
        with self.db.begin() as conn:
            ids = [row.id for row in _claimable(conn, (runs.c.id,), due, limit)]
            claimed: list[tuple[str, str]] = []
            for run_id in ids:
                row = conn.execute(
                    update(runs)
                    .where(runs.c.id == run_id, due)
                    .values(
                        redispatch_at=now + self.grace * (runs.c.dispatches + 1),
                        dispatches=runs.c.dispatches + 1,
                    )
                    .returning(runs.c.queue)
                ).first()
                if row is not None:
                    claimed.append((run_id, row.queue))
            return claimed

    # --- incidents --------------------------------------------------------------

    def incident(
        self,
        kind: Incident,
        run_id: str | None,
        step_id: str | None = None,
        epoch: int | None = None,
        worker: str | None = None,
        detail: str | None = None,
    ) -> None:
        with self.db.begin() as conn:
            self._incident(conn, kind, run_id, step_id, epoch, worker, detail)

    def _incident(
        self,
        conn: Connection,
        kind: Incident,
        run_id: str | None,
        step_id: str | None,
        epoch: int | None,
        worker: str | None,
        detail: str | None = None,
    ) -> None:
        conn.execute(
            insert(incidents).values(
                kind=kind,
                run_id=run_id,
                step_id=step_id,
                epoch=epoch,
                worker=worker,
                detail=detail,
                at=db_now(),
            )
        )

    # --- dead messages: broker messages that were not fleet's -------------------------

    def set_aside_message(self, queue: str, reason: str, raw: str) -> int:
        """Keep a message the broker delivered that is not fleet's (see fleet.envelope),
        once; its id. Each value is clipped here, whatever the caller sends."""
        with self.db.begin() as conn:
            result = conn.execute(
                insert(dead_messages).values(
                    queue=_clip_text(queue, 200),
                    reason=_clip_text(reason, 1000),
                    body=_clip_text(raw, DEAD_MESSAGE_MAX_BYTES),
                    at=db_now(),
                )
            )
            key = result.inserted_primary_key
            assert key is not None
            return int(key[0])

    def purge_dead_messages(self, ids: list[int] | None) -> int:
        """Delete the dead messages with these ids (None: all of them); how many went."""
        stmt = delete(dead_messages)
        if ids is not None:
            if not ids:
                return 0
            stmt = stmt.where(dead_messages.c.id.in_(ids))
        with self.db.begin() as conn:
            return int(conn.execute(stmt).rowcount)

    # --- retention ----------------------------------------------------------------
    # Deletes, not transitions: a finished run and every row of its own go together.
    # fleet/retention.py decides when, fleet/store/pruning.py says what may go; each call
    # here is one short transaction that re-checks that rule on what it deletes.

    def prune_runs(self, run_ids: Sequence[str], cutoff: float) -> dict[str, int]:
        """Delete these runs, if still prunable at ``cutoff``, with their steps, attempts,
        intents, signals, dead letters and incidents. The first statement re-checks the
        rule and (Postgres) locks the rows it keeps; the run rows' own DELETE re-checks it
        again. A run that changed since it was listed (a dead letter replayed: failed →
        running) is left whole. Returns the rows deleted per table (``runs``, ``steps``…)."""
        try:
            with self.db.begin() as conn:
                pick = select(runs.c.id).where(
                    runs.c.id.in_(list(run_ids)), pruning.prunable(cutoff)
                )
                if conn.dialect.name == "postgresql":
                    # A run row another transaction is writing is skipped, never waited on.
                    pick = pick.with_for_update(skip_locked=True)
                ids = list(conn.execute(pick).scalars())
                if not ids:
                    return {}
                counts = {
                    pruning.short_name(table): conn.execute(
                        delete(table).where(table.c.run_id.in_(ids))
                    ).rowcount
                    for table in pruning.CHILDREN
                }
                counts["runs"] = conn.execute(
                    delete(runs).where(runs.c.id.in_(ids), pruning.prunable(cutoff))
                ).rowcount
                if counts["runs"] != len(ids):
                    raise _Rollback  # a run changed under the lock: none of the batch goes
                return counts
        except _Rollback:
            log.warning("retention: a run changed while its batch was pruned; batch undone")
            return {}

    def prune_blobs(self, after: str, limit: int, grace: float) -> tuple[int, str]:
        """Of the next ``limit`` blobs after digest ``after``, delete those no row
        references, unless stored (or stored again) in the last ``grace`` seconds. The
        reference check is part of the DELETE itself, so a reference committed before it
        keeps the blob; a writer that has just stored the blob and not yet committed its
        reference is protected by ``grace`` (``put_blob`` moves ``created_at`` to now).
        Returns how many were deleted and the last digest looked at ("" at the end)."""
        with self.db.begin() as conn:
            digests = pruning.next_blobs(conn, after, limit)
            if not digests:
                return 0, ""
            deleted = conn.execute(
                delete(blobs).where(
                    blobs.c.digest.in_(digests),
                    pruning.stale_blob(grace),
                    *[not_(found) for found in pruning.referenced()],
                )
            ).rowcount
            return deleted, digests[-1]


# A dead message's body is kept up to this many bytes of UTF-8.
DEAD_MESSAGE_MAX_BYTES = 64 * 1024


def _clip_text(text: str, max_bytes: int) -> str:
    """At most ``max_bytes`` of UTF-8, whole characters only; no NUL (Postgres text
    cannot hold one) and no lone surrogate (not encodable)."""
    data = text.encode("utf-8", "backslashreplace").replace(b"\x00", b"\\x00")
    return data[:max_bytes].decode("utf-8", "ignore")
