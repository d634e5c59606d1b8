"""The ledger's step transitions: an attempt's lease, its end (commit, retry, dead
letter, in doubt), a dead letter's replay, and an effect's intents.

Each method opens one transaction (or runs in the caller's: ``within``), runs the
one statement that decides (from ``fleet/store/transitions.py``), handles its
zero-rows case by name (fenced, not takeable and why, not replayable and why), then
makes the derived writes in the same transaction: the attempt log, intents,
incidents, the dead letter, the wake-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import and_, select
from sqlalchemy.engine import Connection

from fleet.states import AttemptOutcome, Incident, IntentOutcome, StepStatus
from fleet.store import audit, derived, driver, fused, takes
from fleet.store import transitions as sql
from fleet.store.rows import RunRow
from fleet.store.schema import dead_letters, steps
from fleet.store.snapshots import HistoryRead, Snapshot, read_snapshot
from fleet.store.takes import Lease, TakeRefused
from fleet.store.upkeep import Upkeep


class ReplayRefused(StrEnum):
    """Why a dead letter was not replayed: the zero-rows cases of ``replay_dead_letter``."""

    NOT_FOUND = "no such dead letter"
    ALREADY_REPLAYED = "already replayed"
    RUN_FINISHED = "its run has succeeded or was cancelled"
    STEP_NOT_DEAD = "its step is no longer dead"


@dataclass(frozen=True)
class Committed:
    """What ``commit_output`` did: true when the output was recorded (false: fenced).
    ``snapshot``, when asked for, is the run as the same transaction left it.
    ``replay`` false: the step is a branch of a fan-out whose siblings have not all
    settled, so the run was not woken and is not to be replayed (no snapshot read)."""

    applied: bool
    snapshot: Snapshot | None = None
    replay: bool = True

    def __bool__(self) -> bool:
        return self.applied


class LetterId(int):
    """A dead letter's id, as ``dead_letter`` returns it, with whether the run was woken
    with it (``replay``; false: a branch of a fan-out whose siblings have not all
    settled, so nothing is to be replayed yet)."""

    replay: bool

    def __new__(cls, letter_id: int, replay: bool) -> LetterId:
        made = super().__new__(cls, letter_id)
        made.replay = replay
        return made


def _key(run_id: str, step_id: str, epoch: int) -> dict[str, Any]:
    """The parameters of a fenced statement: the step and the epoch its writer holds."""
    return {"b_run": run_id, "b_step": step_id, "b_epoch": epoch}


_WHY_NOT_REPLAYED = (
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
    .where(dead_letters.c.id == sql.LETTER)
)


class StepLedger(Upkeep):
    """Step transitions; composed into ``fleet.store.ledger.Ledger``."""

    # --- one attempt ----------------------------------------------------------

    def take_lease(
        self, run_id: str, step_id: str, owner: str, lease_seconds: float, limited: bool = True
    ) -> Lease | TakeRefused:
        """take_lease: pending | due retry | expired running → running, epoch+1 and
        attempts+1 in one write, only while the run is live and the attempt cap is not
        spent. Zero rows: why not, named (``TakeRefused``). ``limited`` false: the caller
        read that the run has no spend limits (``RunRow.limited``), so no spend is summed;
        the statement checks it, and takes as for a run with limits if it has some."""
        if self.tx is None and self.db.wired:
            # Its own transaction, sent whole with the take (one round trip).
            return self._take_sent(run_id, step_id, owner, lease_seconds, limited)()
        key = {"b_run": run_id, "b_step": step_id}
        with self.db.begin(self.tx) as conn:
            params = {**key, "b_owner": owner, "b_lease": lease_seconds}
            taken = takes.take_in(conn, params, limited)
            if taken is None:
                why = takes.why_not_taken(conn, key, limited)
                if why is not None:
                    return why
                # Taken as for a run without limits, and the run has some.
                taken = takes.take_in(conn, params, True)
                if taken is None:
                    return takes.why_not_taken(conn, key) or TakeRefused.NOT_DUE
            epoch, attempt, name, input_, took_over, branch = taken
            if took_over:
                self._incident(conn, Incident.TAKEOVER, run_id, step_id, epoch, owner)
            return Lease(run_id, step_id, epoch, attempt, name, input_, took_over, branch)

    def take_lease_at_commit(
        self, run_id: str, step_id: str, owner: str, lease_seconds: float, limited: bool = True
    ) -> Callable[[], Lease | TakeRefused]:
        """``take_lease`` in the transaction this ledger is bound to, its answer given
        by the function returned, called once that transaction has committed. On
        Postgres the take goes out with the COMMIT, in its round trip, a takeover's
        incident noted in the same statement; why a lease was refused is then asked in
        a transaction of its own. Unbound, or on SQLite: taken now."""
        if self.tx is None or self.db.dialect != fused.DIALECT:
            answer = self.take_lease(run_id, step_id, owner, lease_seconds, limited)
            return lambda: answer
        return self._take_sent(run_id, step_id, owner, lease_seconds, limited)

    def _take_sent(
        self, run_id: str, step_id: str, owner: str, lease_seconds: float, limited: bool
    ) -> Callable[[], Lease | TakeRefused]:
        """The take sent with the COMMIT of this ledger's transaction (or its own, sent
        whole); answered once that has committed."""
        key = {"b_run": run_id, "b_step": step_id}
        with self.db.begin(self.tx) as conn:
            params = {**key, "b_owner": owner, "b_lease": lease_seconds}
            pending = driver.send(conn, fused.TAKE_OPEN_AND_NOTE[limited], params)

        def answered() -> Lease | TakeRefused:
            taken = pending.rows().first()
            if taken is None:
                with self.db.begin(read=True) as conn:
                    why = takes.why_not_taken(conn, key, limited)
                if why is not None:
                    return why
                # Taken as for a run without limits, and the run has some: taken again,
                # in a transaction of its own (this ledger's has committed).
                alone = type(self)(self.db, self.grace)
                return alone.take_lease(run_id, step_id, owner, lease_seconds)
            epoch, attempt, name, input_, lost, fanout = taken
            branch = fanout is not None
            return Lease(run_id, step_id, epoch, attempt, name, input_, lost > 0, branch)

        return answered

    def heartbeat(self, run_id: str, step_id: str, epoch: int, lease_seconds: float) -> bool:
        """Extend a held lease. False: the lease was lost (taken over or revoked)."""
        with self.db.begin(self.tx) as conn:
            params = {**_key(run_id, step_id, epoch), "b_lease": lease_seconds}
            return driver.run(conn, sql.RENEW, params).rowcount == 1

    def release_lease(self, run_id: str, step_id: str, epoch: int) -> bool:
        """A worker shutting down gives a held lease up: it expires now. False: it was
        not held any more (taken over, revoked, or the step finished)."""
        with self.db.begin(self.tx) as conn:
            return conn.execute(sql.RELEASE, _key(run_id, step_id, epoch)).rowcount == 1

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
        created_at: float | None = None,
        branch: bool = False,
    ) -> Committed:
        """commit_output: running → done, only under the epoch held. Zero rows is a
        fenced write: the lease was taken over (or revoked) since this attempt took it;
        counted, never applied. ``effect``: the step is an effect, whose intents settle
        with the commit (no other step writes intents). With ``snapshot``, an applied
        commit also reads the run and its history for the replay that follows (one
        transaction instead of two). A branch of a fan-out wakes the run only if it is
        the last to settle (``Committed.replay``). ``created_at``: the run's creation
        time as the caller read it; on Postgres the history is then read in the same
        round trip as the commit (and read again, after it, if the run turns out to be
        another one of that id). ``branch``: the lease said the step is a branch (on
        Postgres, with ``snapshot``: counted settled in the commit's statement, and no
        history read with it; see ``_commit_fused``)."""
        with self.db.begin(self.tx) as conn:
            key = _key(run_id, step_id, epoch)
            on_one = snapshot and conn.dialect.name == fused.DIALECT
            history: tuple[HistoryRead, Any] | None = None
            if on_one:
                row, history = self._commit_fused(conn, key, output, created_at, branch)
            else:
                row = driver.run(conn, sql.COMMIT, {**key, "b_output": output}).first()
                if row is not None:
                    self._close_attempt(conn, run_id, step_id, epoch, AttemptOutcome.DONE)
            if row is None:  # fenced
                self._close_attempt(conn, run_id, step_id, epoch, AttemptOutcome.FENCED)
                self._incident(conn, Incident.FENCED_WRITE, run_id, step_id, epoch, None)
                return Committed(False)
            # An effect's outcome commits with its checkpoint (and with ``earlier_intents``
            # set, the in-doubt intents of earlier attempts are settled with it).
            if effect:
                self._settle_intents(conn, run_id, step_id, IntentOutcome.DONE, epoch=epoch)
            if earlier_intents is not None:
                self._settle_intents(conn, run_id, step_id, earlier_intents, before=epoch)
            # The run as the commit's statement woke it (None: it did not).
            woken = row[1:] if on_one and row.id is not None else None
            if on_one and branch:  # counted in the commit's statement
                unsettled = woken is None
            else:
                unsettled = row.fanout is not None and not self._branch_settled(
                    conn, run_id, step_id
                )
            if unsettled:
                return Committed(True, replay=False)  # siblings unsettled: no wake-up
            if not snapshot:
                self._wake(conn, run_id)
                return Committed(True)
            if woken is None:
                # The wake-up returns the run row the replay needs: one read fewer.
                wake = {"b_run": run_id, "b_grace": self.grace}
                woken = driver.run(conn, derived.WAKE_RETURNING, wake).first()
            elif history is not None:
                run = RunRow.from_row(woken)
                if run.created_at == created_at:
                    read, rows = history
                    return Committed(True, read.snapshot(conn, run, rows))
            return Committed(True, read_snapshot(conn, run_id, self.db.history, run=woken))

    def _commit_fused(
        self,
        conn: Connection,
        key: dict[str, Any],
        output: str,
        created_at: float | None,
        branch: bool,
    ) -> tuple[Any, tuple[HistoryRead, Any] | None]:
        """The commit as one statement (Postgres), its attempt closed with it: the run
        woken and read with it unless the step is a branch (``fused.COMMIT_AND_WAKE``),
        or, for a branch, the branch counted settled too and the run woken and read
        only if it was the last to settle (``fused.COMMIT_AND_SETTLE``). Its row (None:
        fenced) and, with ``created_at`` and not a branch, the history after the commit
        read in the same round trip. A branch's commit reads no history: one that is
        not the last replays nothing, and the last reads it after its count (read with
        every branch's commit, as it was from 6f163a5, a map of N read N² rows)."""
        params = {**key, "b_output": output, "b_grace": self.grace}
        if branch:
            return driver.run(conn, fused.COMMIT_AND_SETTLE, params).first(), None
        if created_at is None:
            return driver.run(conn, fused.COMMIT_AND_WAKE, params).first(), None
        read = HistoryRead.of(key["b_run"], created_at, self.db.history)
        calls = [(fused.COMMIT_AND_WAKE, params), (read.stmt, read.params)]
        committed, rows = driver.pipelined(conn, calls)
        return committed.first(), (read, rows)

    def schedule_retry(
        self, run_id: str, step_id: str, epoch: int, delay: float, error: str, *, countdown: bool
    ) -> bool:
        """schedule_retry: running → retry_wait with its due time in the store. False:
        fenced. With ``countdown`` the caller sends a delayed message itself, so the
        sweeper waits one grace period past the due time before it re-sends."""
        with self.db.begin(self.tx) as conn:
            params = {
                **_key(run_id, step_id, epoch),
                "b_delay": delay,
                "b_error": error,
                "b_resend_after": self.grace if countdown else 0.0,
            }
            fenced = conn.execute(sql.SCHEDULE_RETRY, params).rowcount != 1
            if fenced:
                self._close_attempt(conn, run_id, step_id, epoch, AttemptOutcome.FENCED, error)
                self._incident(conn, Incident.FENCED_WRITE, run_id, step_id, epoch, None)
                return False
            # The step raised: it reports that its effect did not happen.
            self._settle_intents(conn, run_id, step_id, IntentOutcome.FAILED, epoch=epoch)
            self._close_attempt(conn, run_id, step_id, epoch, AttemptOutcome.FAILED, error)
            return True

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
    ) -> LetterId | None:
        """dead_letter: running → dead (``epoch`` held), or dead_letter_exhausted, with
        ``epoch=None``: a step whose cap was spent by attempts that crashed, pending |
        due retry | expired running → dead. The dead letter and the run's wake-up commit
        with it (no wake-up for a branch whose siblings have not all settled). Returns
        the dead letter's id; None when fenced (``epoch`` given) or raced (another
        writer settled the step first)."""
        error = f"{error_type}: {error_message}"
        key = {"b_run": run_id, "b_step": step_id}
        with self.db.begin(self.tx) as conn:
            if epoch is None:
                row = conn.execute(sql.DEAD_LETTER_EXHAUSTED, {**key, "b_error": error}).first()
                if row is None:
                    return None  # raced: the step was taken or settled meanwhile
            else:
                params = {**key, "b_epoch": epoch, "b_error": error}
                row = conn.execute(sql.DEAD_LETTER, params).first()
                if row is None:  # fenced
                    self._close_attempt(conn, run_id, step_id, epoch, AttemptOutcome.FENCED, error)
                    self._incident(conn, Incident.FENCED_WRITE, run_id, step_id, epoch, None)
                    return None
                self._close_attempt(conn, run_id, step_id, epoch, AttemptOutcome.FAILED, error)
                self._settle_intents(conn, run_id, step_id, IntentOutcome.FAILED, epoch=epoch)
            letter = {
                **key,
                "b_workflow": workflow,
                "b_name": row.name,
                "b_input": row.input,
                "b_error_type": error_type,
                "b_error_message": error_message,
                "b_traceback": traceback,
                "b_attempt": row.attempts,
            }
            letter_id = conn.execute(derived.FILE_DEAD_LETTER, letter).scalar_one()
            wake = self._branch_settled(conn, run_id, step_id)
            if wake:
                self._wake(conn, run_id)
            return LetterId(letter_id, replay=wake)

    def replay_dead_letter(
        self, letter_id: int, new_input: str | None, action: audit.Action | None = None
    ) -> ReplayRefused | None:
        """replay_step and replay_run: the letter is marked (kept, not deleted), the step
        goes dead → pending with a fresh attempt budget (its epoch keeps counting up, so
        no old lease can match again; a branch is uncounted from its fan-out's settled),
        and a failed run goes back to running. None on
        success; otherwise why not, with nothing written.

        The first statement decides, re-checking the step and the run inside its WHERE
        clause; the two after it cannot miss, as only a replay moves a step out of dead.
        """
        with self.db.begin(self.tx) as conn:
            letter = conn.execute(sql.REPLAY_LETTER, {"b_letter": letter_id}).first()
            if letter is None:
                return self._why_not_replayed(conn, letter_id)
            run_id, step_id = letter
            step = {"b_run": run_id, "b_step": step_id, "b_input": new_input}
            conn.execute(sql.REPLAY_STEP, {**step, "b_grace": self.grace})
            self._branch_unsettled(conn, run_id, step_id)
            conn.execute(sql.REPLAY_RUN, {"b_run": run_id})
            self._audit(conn, action, run_id)
            return None

    @staticmethod
    def _audit(conn: Connection, action: audit.Action | None, run_id: str) -> None:
        """An operator's ``action`` on ``run_id``, recorded in the transaction of the
        change it made (called once that change has applied; None: not recorded)."""
        if action is not None:
            conn.execute(audit.RECORD, action.params(run_id))

    @staticmethod
    def _why_not_replayed(conn: Connection, letter_id: int) -> ReplayRefused:
        row = conn.execute(_WHY_NOT_REPLAYED, {"b_letter": letter_id}).first()
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
        with self.db.begin(self.tx) as conn:
            params = {**_key(run_id, step_id, epoch), "b_key": key, "b_input_hash": input_hash}
            return conn.execute(derived.WRITE_INTENT, params).first() is not None

    def supersede_intents(self, run_id: str, step_id: str, epoch: int) -> bool:
        """Earlier in-doubt intents will be retried under this epoch's key (an idempotent
        effect, or its reconcile hook said it had not happened). False: lease lost."""
        with self.db.begin(self.tx) as conn:
            if conn.execute(derived.HELD, _key(run_id, step_id, epoch)).first() is None:
                return False  # fenced
            self._settle_intents(conn, run_id, step_id, IntentOutcome.SUPERSEDED, before=epoch)
            return True

    def park_in_doubt(self, run_id: str, step_id: str, epoch: int) -> bool:
        """park_in_doubt: step running → in_doubt, and park_run_in_doubt: run running →
        needs_decision. An earlier attempt may have acted, the step cannot ask the world,
        and retrying would be a guess. False: fenced."""
        with self.db.begin(self.tx) as conn:
            if conn.execute(sql.PARK_IN_DOUBT, _key(run_id, step_id, epoch)).rowcount != 1:
                return False  # fenced
            self._close_attempt(
                conn,
                run_id,
                step_id,
                epoch,
                AttemptOutcome.FAILED,
                "an earlier attempt may have acted: needs a decision",
            )
            conn.execute(sql.PARK_RUN_IN_DOUBT, {"b_run": run_id})
            self._incident(conn, Incident.EFFECT_IN_DOUBT, run_id, step_id, epoch, None)
            return True
