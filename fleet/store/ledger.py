"""The one writer. Every state change in fleet is a method of ``Ledger``, and every
method follows one shape:

1. open the transaction (``self.db.begin(self.tx)``: its own, or, for a ledger bound
   to the caller's transaction with ``within(tx)``, a part of that one);
2. run the one conditional statement that decides (``UPDATE … WHERE status IN
   (sources) AND epoch = :held``, or an insert that is a no-op on conflict), from
   ``fleet/store/transitions.py``, named after its entry of ``fleet.states.TRANSITIONS``;
3. handle its zero-rows case explicitly and by name (a fenced write, a duplicate
   delivery, an invalid transition), writing nothing more or only its incident;
4. make the derived writes that must not be lost if the process dies right after
   the transition (the attempt log, intents, a dead letter, the run's wake-up) in
   the same transaction, so the store never holds half a transition. They cannot
   miss: the deciding statement has already checked what they depend on.

This module holds the run transitions, waits and signals, and the steps a replay
records; ``family`` a run's cancel and what a run that ends owes its parent and
children; ``step_ledger`` an attempt's transitions and effects; ``upkeep`` the writes
that change no status (the sweeper's claims, incidents, blobs, spend, retention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.sql.expression import Executable

from fleet.states import IntentOutcome, RunStatus, StepKind, StepStatus
from fleet.store import audit, derived, driver, fused
from fleet.store import messages as transcripts
from fleet.store import transitions as sql
from fleet.store.family import Family
from fleet.store.messages import NewCompaction, NewMessage
from fleet.store.step_ledger import Committed, Lease, ReplayRefused, TakeRefused
from fleet.store.sweeps import DUE_WAITS
from fleet.store.upkeep import DEAD_MESSAGE_MAX_BYTES

__all__ = [
    "DEAD_MESSAGE_MAX_BYTES",
    "Committed",
    "Lease",
    "Ledger",
    "NewCompaction",
    "NewChild",
    "NewMessage",
    "NewStep",
    "ReplayRefused",
    "TakeRefused",
]

# What a replay moves its run from, and the transition that does it (``begin_replay``).
_BEGIN_REPLAY = {RunStatus.QUEUED: sql.START_RUN, RunStatus.WAITING: sql.RESUME_RUN}


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
    # A branch of a fan-out (wf.map, wf.parallel): the seq of its first branch. The
    # fan-out's settle count is recorded with its branches (fleet_fanouts).
    fanout: int | None = None
    child: NewChild | None = None  # a child step (wf.child): the run it starts


@dataclass(frozen=True)
class NewChild:
    """The run a child step starts, inserted in the transaction that records the step
    (so a replayed parent never starts a second one): its id is ``{parent}/{step id}``.
    ``create_run`` describes an enqueued run with it too (no parent, not detached)."""

    run_id: str
    workflow: str
    version: str
    pins: str
    args: str
    queue: str
    budget_tokens: int | None = None
    budget_cost: float | None = None
    detached: bool = False
    tenant: str | None = None  # a child run's is its parent's, read by CREATE_RUN


class Ledger(Family):
    """Every write to the store. Methods return whether their transition applied."""

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
        tenant: str | None = None,
    ) -> bool:
        """Insert a queued run; False when ``run_id`` exists already (enqueue is idempotent)."""
        run = NewChild(
            run_id, workflow, version, pins, args, queue, budget_tokens, budget_cost, tenant=tenant
        )
        return run_id in self.create_runs([run])

    def create_runs(self, new: Sequence[NewChild]) -> set[str]:
        """Insert queued runs in one statement (one, or concurrent ``aenqueue`` calls'):
        the ids it inserted; the others existed already (enqueue is idempotent). One run
        on Postgres: its insert goes out with the COMMIT, one round trip, read after it."""
        params = [_run_params(run, self.grace) for run in new]
        with self.db.begin(self.tx) as conn:
            stmt = sql.CREATE_RUN[conn.dialect.name]
            if len(params) != 1:
                return {row.id for row in conn.execute(stmt, params)}
            sent = driver.send(conn, stmt, params[0])
        return {row.id for row in sent.rows()}

    def start_run(self, run_id: str) -> bool:
        """start_run: queued → running. False: another advance started it first (harmless)."""
        return self._move_run(sql.START_RUN, run_id)

    def finish_run(
        self, run_id: str, status: RunStatus, *, result: str | None = None, error: str | None = None
    ) -> bool:
        """succeed_run | fail_run: running → succeeded | failed. False: a concurrent
        advance finished it first, or it was cancelled meanwhile (both mean: nothing to do).
        A step still running when its run ends (a branch the workflow did not wait for)
        has its lease revoked in the same transaction, as ``cancel_run`` does: its commit
        is fenced and nothing of the run runs after it is over."""
        assert status in (RunStatus.SUCCEEDED, RunStatus.FAILED)
        stmt = sql.FINISH_RUN[status]
        with self.db.begin(self.tx) as conn:
            params = {"b_run": run_id, "b_output": result, "b_error": error}
            family = driver.run(conn, stmt, params).first()
            if family is None:
                return False
            # Sent, not waited for: it goes out with the COMMIT (fleet/store/driver.py).
            driver.send(conn, sql.REVOKE_LEASES, {"b_run": run_id})
            if family.parent_id is not None or family.live_children:
                text = result if status is RunStatus.SUCCEEDED else error
                self._ended(conn, run_id, status, text, parent=family)
            return True

    def set_waiting(self, run_id: str, seen_wake: int) -> bool:
        """set_waiting: running → waiting: the replay stopped at a wait, no worker held.
        False also if the run was woken after the replay read it (its ``wake_seq`` is
        past ``seen_wake``): a newer replay is due, or has moved the run on already."""
        with self.db.begin(self.tx) as conn:
            params = {"b_run": run_id, "b_wake": seen_wake}
            return conn.execute(sql.SET_WAITING, params).rowcount == 1

    def resume_run(self, run_id: str) -> bool:
        """resume_run: waiting → running, before a replay acts on a signal or a timer."""
        return self._move_run(sql.RESUME_RUN, run_id)

    def begin_replay(self, run_id: str, status: RunStatus) -> None:
        """Before a replay acts: start_run (queued → running) or resume_run (waiting →
        running), by ``status`` as the replay read it; nothing for a running run. In a
        bound transaction it goes out with the replay's next statements, its answer not
        waited for: zero rows means another advance moved the run first (harmless,
        the replay's own writes are conditional too)."""
        stmt = _BEGIN_REPLAY.get(status)
        if stmt is None:
            return
        with self.db.begin(self.tx) as conn:
            driver.send(conn, stmt, {"b_run": run_id})

    def _move_run(self, stmt: Executable, run_id: str) -> bool:
        """A run transition with no derived writes. False: the run was not in its sources.
        Sent with the COMMIT (one round trip on Postgres) and its count read after."""
        with self.db.begin(self.tx) as conn:
            moved = driver.send(conn, stmt, {"b_run": run_id})
        return moved.rows().rowcount == 1

    # --- decisions: an effect in doubt, a budget -----------------------------------

    def resolve(
        self, run_id: str, step_id: str, output: str | None, action: audit.Action | None = None
    ) -> bool:
        """A person settles an in-doubt effect: with ``output`` it happened (resolve_done:
        in_doubt → done), without it it is to be retried (resolve_retry: in_doubt →
        pending, one more attempt allowed). The run goes back to running (resolve_run).
        False: the step was not in doubt (or its run not waiting for a decision)."""
        key: dict[str, Any] = {"b_run": run_id, "b_step": step_id}
        params: dict[str, Any]
        if output is not None:
            stmt, params, settled = (
                sql.RESOLVE_DONE,
                {**key, "b_output": output},
                IntentOutcome.RESOLVED,
            )
        else:
            stmt, params, settled = (
                sql.RESOLVE_RETRY,
                {**key, "b_grace": self.grace},
                IntentOutcome.SUPERSEDED,
            )
        with self.db.begin(self.tx) as conn:
            if conn.execute(stmt, params).rowcount != 1:
                return False  # not in doubt: resolved already, or never was
            self._settle_intents(conn, run_id, step_id, settled)
            conn.execute(sql.RESOLVE_RUN, {"b_run": run_id})
            # Done: a branch wakes the run only as the last of its fan-out to settle.
            if output is None or self._branch_settled(conn, run_id, step_id):
                self._wake(conn, run_id)
            self._audit(conn, action, run_id)
            return True

    def park_over_budget(self, run_id: str) -> bool:
        """park_over_budget: running → needs_decision ("budget"), re-checking in the same
        statement that the recorded spend has reached the budget. False: not (or no
        longer) over it, or not running."""
        return self._move_run(sql.PARK_OVER_BUDGET, run_id)

    def raise_budget(
        self,
        run_id: str,
        tokens: int | None,
        cost: float | None,
        action: audit.Action | None = None,
    ) -> bool:
        """raise_budget: needs_decision ("budget") → running with new limits (None: that
        limit stays). The caller sends the run's takeable steps; the sweeper re-sends them
        after grace if that is lost. False: the run was not parked for budget."""
        with self.db.begin(self.tx) as conn:
            params = {"b_run": run_id, "b_tokens": tokens, "b_cost": cost}
            if conn.execute(sql.RAISE_BUDGET, params).rowcount != 1:
                return False  # not parked for budget
            conn.execute(derived.REDISPATCH_TAKEABLE, {"b_run": run_id, "b_grace": self.grace})
            self._audit(conn, action, run_id)
            return True

    # --- signals and timers -------------------------------------------------------

    def add_signal(
        self, run_id: str, name: str, payload: str, action: audit.Action | None = None
    ) -> int | None:
        """Keep a signal for the run's waits; None if the run is not live (anymore)."""
        with self.db.begin(self.tx) as conn:
            params = {"b_run": run_id, "b_name": name, "b_payload": payload}
            row = conn.execute(sql.ADD_SIGNAL, params).first()
            if row is not None:
                self._audit(conn, action, run_id)
            return None if row is None else int(row[0])

    def answer_wait(
        self,
        run_id: str,
        wait_id: str,
        name: str,
        payload: str,
        action: audit.Action | None = None,
    ) -> bool:
        """answer_wait (deliver_signal, addressed): the signal settles the open wait
        ``wait_id`` of a live run, a ``wait_for(name)``, or nothing is written (False).
        The wait's pending → done decides, so of two submissions of one decision exactly
        one applies; the signal is kept as consumed by that wait, never left for a later
        one (invariant 14)."""
        params = {
            "b_run": run_id,
            "b_step": wait_id,
            "b_name": name,
            "b_wait_name": f"wait:{name}",
            "b_payload": payload,
        }
        with self.db.begin(self.tx) as conn:
            if conn.execute(sql.ANSWER_WAIT, params).rowcount != 1:
                return False  # not an open wait for that signal (answered, timed out, ended)
            conn.execute(sql.KEEP_ANSWER, params)
            self._wake(conn, run_id)
            self._audit(conn, action, run_id)
            return True

    def deliver_signals(self, run_id: str) -> int:
        """deliver_signal: hand each pending wait of the run the oldest unconsumed signal
        of its name, earliest wait first, so two signals of one name are consumed in
        order. Each hand-over is two conditional writes in one savepoint: the signal is
        consumed only if the wait was still pending. Returns how many waits settled."""
        delivered = 0
        with self.db.begin(self.tx) as conn:
            for step_id, wait_name in conn.execute(sql.PENDING_WAITS, {"b_run": run_id}).all():
                name = wait_name[len("wait:") :]
                signal = conn.execute(sql.OLDEST_SIGNAL, {"b_run": run_id, "b_name": name}).first()
                if signal is None:
                    continue
                handover = conn.begin_nested()
                consumed = conn.execute(
                    sql.CONSUME_SIGNAL, {"b_signal": signal.id, "b_step": step_id}
                )
                params = {"b_run": run_id, "b_step": step_id, "b_payload": signal.payload}
                if consumed.rowcount != 1 or conn.execute(sql.DELIVER_SIGNAL, params).rowcount != 1:
                    handover.rollback()  # a concurrent delivery or the timeout got there first
                    continue
                handover.commit()
                delivered += 1
            if delivered:
                self._wake(conn, run_id)
        return delivered

    def fire_due_waits(self, limit: int = 500) -> list[tuple[str, str]]:
        """fire_due_wait: settle waits and sleeps whose due time has come (a wait's
        timeout returns None) and wake their runs. Returns (run_id, queue) of each
        woken run."""
        with self.db.begin(self.tx) as conn:
            woken: dict[str, str] = {}
            for run_id, step_id in conn.execute(DUE_WAITS, {"b_limit": limit}).all():
                key = {"b_run": run_id, "b_step": step_id}
                if conn.execute(sql.FIRE_DUE_WAIT, key).rowcount != 1:
                    continue  # settled since it was listed: a signal got there first
                self._wake(conn, run_id)
                woken[run_id] = conn.execute(sql.RUN_QUEUE, key).one().queue
            return list(woken.items())

    def mark_advanced(self, run_id: str, seq: int) -> None:
        """Record that a replay has seen every wake-up up to ``seq``. Zero rows: a later
        advance already recorded more (monotonic, so nothing is lost)."""
        with self.db.begin(self.tx) as conn:
            driver.send(conn, derived.MARK_ADVANCED, {"b_run": run_id, "b_advanced": seq})

    # --- steps recorded by replay --------------------------------------------

    def record_steps(
        self,
        run_id: str,
        new: Sequence[NewStep],
        advanced_seq: int | None = None,
        messages: Sequence[NewMessage] = (),
        compactions: Sequence[NewCompaction] = (),
    ) -> None:
        """Insert steps the replay reached; a no-op for any a concurrent replay inserted.
        Step ids and positions are deterministic, so both replays insert the same rows.
        With ``advanced_seq``, this is the replay's last write: ``mark_advanced`` is done
        in the same transaction. ``messages`` the replay appended to its transcripts
        before reaching them, and the ``compactions`` those steps make, are inserted
        first, the same way (positions are deterministic too). Branches of a fan-out
        (``NewStep.fanout``) get its settle count, in the same transaction."""
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
                "b_fanout": s.fanout,
            }
            for s in new
        ]
        fanouts = _fanouts(run_id, new)
        with self.db.begin(self.tx) as conn:
            dialect = conn.dialect.name
            alone = len(new) == 1 and new[0].child is None and not (messages or compactions)
            if dialect == fused.DIALECT and alone and advanced_seq is not None:
                # A replay's usual end in one statement: its one next step, marked
                # advanced. Sent, not waited for: it goes out with the next statement
                # or the COMMIT (fleet/store/driver.py).
                driver.send(conn, fused.RECORD_AND_ADVANCE, {**rows[0], "b_advanced": advanced_seq})
                return
            if messages:
                conn.execute(
                    transcripts.APPEND[dialect], transcripts.message_params(run_id, messages)
                )
            if compactions:
                conn.execute(
                    transcripts.COMPACTION[dialect],
                    transcripts.compaction_params(run_id, compactions),
                )
            if rows:
                # One prebuilt statement; several rows (a fan-out) go as one executemany.
                driver.run(conn, sql.RECORD_STEP[dialect], rows)
            for s in new:
                if s.child is not None:
                    params = _run_params(s.child, self.grace, parent=(run_id, s.step_id))
                    conn.execute(sql.CREATE_RUN[dialect], params)
            if fanouts:
                conn.execute(derived.RECORD_FANOUT[dialect], fanouts)
            if advanced_seq is not None:
                advanced = {"b_run": run_id, "b_advanced": advanced_seq}
                driver.run(conn, derived.MARK_ADVANCED, advanced)


def _run_params(
    run: NewChild, grace: float, parent: tuple[str, str] | None = None
) -> dict[str, Any]:
    """CREATE_RUN's parameters for a queued run: an enqueued one, or the run a child step
    starts (``parent``: the parent run's id and that step's, named on it)."""
    parent_id, parent_step = parent or (None, None)
    return {
        "b_run": run.run_id,
        "b_workflow": run.workflow,
        "b_version": run.version,
        "b_pins": run.pins,
        "b_args": run.args,
        "b_queue": run.queue,
        "b_budget_tokens": run.budget_tokens,
        "b_budget_cost": run.budget_cost,
        "b_grace": grace,
        "b_parent": parent_id,
        "b_parent_step": parent_step,
        "b_detached": run.detached,
        "b_tenant": run.tenant,
    }


def _fanouts(run_id: str, new: Sequence[NewStep]) -> list[dict[str, Any]]:
    """One settle count per fan-out among ``new``: its size, and how many of its
    branches are recorded settled already (values are recorded done)."""
    counts: dict[int, list[int]] = {}
    for s in new:
        if s.fanout is not None:
            size_settled = counts.setdefault(s.fanout, [0, 0])
            size_settled[0] += 1
            size_settled[1] += s.kind == StepKind.VALUE
    return [
        {"b_run": run_id, "b_fanout": fanout, "b_size": size, "b_settled": settled}
        for fanout, (size, settled) in counts.items()
    ]
