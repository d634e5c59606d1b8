"""Reads. Nothing here writes; decisions are never taken on a read alone (the
ledger's conditional writes re-check every condition they depend on)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from sqlalchemy import case, func, select
from sqlalchemy.engine import Connection

from fleet.records import DeadMessageInfo
from fleet.states import IntentOutcome, RunStatus, StepKind, StepStatus
from fleet.store import driver, totals
from fleet.store import messages as transcripts
from fleet.store.engine import Database, Transaction, after_commit, db_now
from fleet.store.message_cache import Recorded
from fleet.store.predicates import RUN, STEP, step_is, tree
from fleet.store.rows import (
    AttemptRow,
    DeadLetterRow,
    Figures,
    IntentRow,
    RunRow,
    StepRow,
)
from fleet.store.schema import (
    attempts,
    blobs,
    dead_letters,
    dead_messages,
    incidents,
    intents,
    runs,
    steps,
)
from fleet.store.snapshots import (
    AGAIN,
    HISTORY,
    RUN_ROW,
    Snapshot,
    read_snapshot,
    snapshot_at_once,
)

T = TypeVar("T", covariant=True)

STEP_ROW = select(steps).where(step_is(RUN, STEP))


class RunEnd(NamedTuple):
    """What a waiter needs of a run: its status and, once ended, its result or error."""

    status: RunStatus
    result: str | None
    error: str | None


class _FromRow(Protocol[T]):
    def from_row(self, row: Any) -> T: ...


def _first(kind: _FromRow[T], result: Any) -> T | None:
    """The first row of ``result`` as ``kind``; None when there is none."""
    row = result.first()
    return None if row is None else kind.from_row(row)


# --- the metrics endpoint's figures ---------------------------------------------------
_DEAD_LETTERS = select(
    func.count(),
    func.coalesce(func.sum(case((dead_letters.c.replayed_at.is_(None), 1), else_=0)), 0),
)
_WAITS_OPEN = select(func.count()).where(
    steps.c.kind == StepKind.WAIT,
    steps.c.status == StepStatus.PENDING,
    runs.c.id == steps.c.run_id,
    runs.c.status.in_([RunStatus.RUNNING, RunStatus.WAITING]),
)
_LIVE_QUEUES = (
    select(runs.c.queue)
    .where(runs.c.status.in_([RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING]))
    .distinct()
)


def _counts(conn: Connection, column: Any) -> dict[str, int]:
    """Rows of ``column``'s table by its value."""
    rows = conn.execute(select(column, func.count()).group_by(column)).all()
    return {str(value): int(n) for value, n in rows}


class Queries:
    """The reads callers make. ``tx``: the transaction every read runs in, if bound to
    one (``within``), so it sees that transaction's own writes; None: each opens its own."""

    def __init__(self, db: Database, tx: Transaction | None = None) -> None:
        self.db = db
        self.tx = tx

    def within(self, tx: Transaction) -> Queries:
        """These reads, run in ``tx``."""
        return Queries(self.db, tx)

    def run(self, run_id: str) -> RunRow | None:
        with self.db.begin(self.tx, read=True) as conn:
            return _first(RunRow, conn.execute(RUN_ROW, {"b_run": run_id}))

    def run_and_step(self, run_id: str, step_id: str) -> tuple[RunRow | None, StepRow | None]:
        """The run and one of its steps, in one transaction: on Postgres, unless bound to
        a caller's, one round trip (its BEGIN, both reads and its COMMIT sent together;
        three before, each delivery of a step paying them: every branch of a map)."""
        params = {"b_run": run_id, "b_step": step_id}
        with self.db.begin(self.tx, read=True) as conn:
            run_read = driver.send(conn, RUN_ROW, params)
            step_read = driver.send(conn, STEP_ROW, params)
            if self.tx is None:
                driver.commit_sent(conn)
            run = _first(RunRow, run_read.rows())
            step = _first(StepRow, step_read.rows()) if run else None
            return run, step

    def snapshot(self, run_id: str) -> Snapshot | None:
        """The run and its history, read in one transaction (one round trip on Postgres,
        with its BEGIN and COMMIT, unless the history read had to be made again)."""
        if self.tx is None:
            sent = snapshot_at_once(self.db, run_id)
            if sent is not AGAIN:
                return sent
        with self.db.begin(self.tx, read=True) as conn:
            return read_snapshot(conn, run_id, self.db.history)

    def runs(
        self,
        status: str | None = None,
        limit: int = 100,
        children: bool = True,
        tenant: str | None = None,
    ) -> list[RunRow]:
        """Runs, newest first; without ``children``, only runs that have no parent;
        with ``tenant``, only that tenant's."""
        stmt = select(runs).order_by(runs.c.created_at.desc()).limit(limit)
        if status:
            stmt = stmt.where(runs.c.status == status)
        if tenant is not None:
            stmt = stmt.where(runs.c.tenant == tenant)
        if not children:
            stmt = stmt.where(runs.c.parent_id.is_(None))
        with self.db.begin(self.tx, read=True) as conn:
            return [RunRow.from_row(row) for row in conn.execute(stmt)]

    def descendants(self, run_id: str, limit: int = 1000) -> list[RunRow]:
        """The run's child runs, theirs too (at most ``limit``), oldest first."""
        ids = select(tree(run_id).c.id)
        stmt = (
            select(runs)
            .where(runs.c.id.in_(ids), runs.c.id != run_id)
            .order_by(runs.c.created_at, runs.c.id)
            .limit(limit)
        )
        with self.db.begin(self.tx, read=True) as conn:
            return [RunRow.from_row(row) for row in conn.execute(stmt)]

    def steps(self, run_id: str) -> list[StepRow]:
        with self.db.begin(self.tx, read=True) as conn:
            return [StepRow.from_row(row) for row in conn.execute(HISTORY, {"b_run": run_id})]

    def progress(self, run_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Per run: (task steps finished, task steps recorded)."""
        finished = func.sum(
            case((steps.c.status.in_([StepStatus.DONE, StepStatus.DEAD]), 1), else_=0)
        )
        stmt = (
            select(steps.c.run_id, finished, func.count())
            .where(steps.c.run_id.in_(list(run_ids)), steps.c.kind == StepKind.TASK)
            .group_by(steps.c.run_id)
        )
        with self.db.begin(self.tx, read=True) as conn:
            return {r: (int(d or 0), int(n)) for r, d, n in conn.execute(stmt).all()}

    def run_ends(self, run_ids: Sequence[str]) -> dict[str, RunEnd]:
        """These runs' status, result and error in one read (the async client's waiters
        share it); an unknown id is left out."""
        if not run_ids:
            return {}
        stmt = select(runs.c.id, runs.c.status, runs.c.result, runs.c.error)
        with self.db.begin(self.tx, read=True) as conn:
            rows = conn.execute(stmt.where(runs.c.id.in_(set(run_ids)))).all()
        return {r.id: RunEnd(RunStatus(r.status), r.result, r.error) for r in rows}

    def leases_held(self, keys: Sequence[tuple[str, str, int]]) -> set[tuple[str, str, int]]:
        """Which of these ``(run id, step id, epoch)`` leases are still held: their step
        running under that epoch (one read for all of a process's watched attempts)."""
        if not keys:
            return set()
        stmt = select(steps.c.run_id, steps.c.step_id, steps.c.epoch).where(
            steps.c.run_id.in_({k[0] for k in keys}), steps.c.status == StepStatus.RUNNING
        )
        with self.db.begin(self.tx, read=True) as conn:
            running = {(r, s, int(e)) for r, s, e in conn.execute(stmt).all()}
        return {k for k in keys if k in running}

    def leased_steps(self, names: Sequence[str]) -> list[tuple[str, str, str, str | None]]:
        """(run id, step id, step name, run's tenant) of each step named ``names`` that
        runs under a live lease (by the store's clock): what holds limits' slots now."""
        if not names:
            return []
        stmt = (
            select(steps.c.run_id, steps.c.step_id, steps.c.name, runs.c.tenant)
            .join(runs, runs.c.id == steps.c.run_id)
            .where(
                steps.c.status == StepStatus.RUNNING,
                steps.c.name.in_(list(names)),
                steps.c.lease_expires_at > db_now(),
            )
        )
        with self.db.begin(self.tx, read=True) as conn:
            return [(r, s, n, t) for r, s, n, t in conn.execute(stmt).all()]

    def step(self, run_id: str, step_id: str) -> StepRow | None:
        with self.db.begin(self.tx, read=True) as conn:
            return _first(StepRow, conn.execute(STEP_ROW, {"b_run": run_id, "b_step": step_id}))

    def attempts(self, run_id: str) -> list[AttemptRow]:
        stmt = (
            select(attempts)
            .where(attempts.c.run_id == run_id)
            .order_by(attempts.c.started_at, attempts.c.epoch)
        )
        with self.db.begin(self.tx, read=True) as conn:
            return [AttemptRow.from_row(row) for row in conn.execute(stmt)]

    def usage(self, run_id: str) -> dict[str, Any]:
        """Calls, tokens and cost of the run's tree: its attempts and those of its child
        runs, theirs too (a subagent's spend is its parent's)."""
        with self.db.begin(self.tx, read=True) as conn:
            row = conn.execute(
                select(
                    func.coalesce(func.sum(attempts.c.calls), 0),
                    func.coalesce(func.sum(attempts.c.input_tokens), 0),
                    func.coalesce(func.sum(attempts.c.output_tokens), 0),
                    func.coalesce(func.sum(attempts.c.cost), 0.0),
                ).where(attempts.c.run_id.in_(select(tree(run_id).c.id)))
            ).one()
        calls, tin, tout, cost = row
        return {
            "calls": int(calls),
            "input_tokens": int(tin),
            "output_tokens": int(tout),
            "tokens": int(tin) + int(tout),
            "cost": float(cost),
        }

    def incident_counts(self, run_id: str | None = None) -> dict[str, int]:
        stmt = select(incidents.c.kind, func.count()).group_by(incidents.c.kind)
        if run_id is not None:
            stmt = stmt.where(incidents.c.run_id == run_id)
        with self.db.begin(self.tx, read=True) as conn:
            return {kind: int(n) for kind, n in conn.execute(stmt).all()}

    def intents(self, run_id: str, step_id: str | None = None) -> list[IntentRow]:
        stmt = select(intents).where(intents.c.run_id == run_id)
        if step_id is not None:
            stmt = stmt.where(intents.c.step_id == step_id)
        with self.db.begin(self.tx, read=True) as conn:
            rows = conn.execute(stmt.order_by(intents.c.step_id, intents.c.epoch))
            return [IntentRow.from_row(row) for row in rows]

    def in_doubt(self, run_id: str, step_id: str, before_epoch: int) -> list[IntentRow]:
        """Intents of earlier attempts that never reported: they may have acted."""
        stmt = select(intents).where(
            intents.c.run_id == run_id,
            intents.c.step_id == step_id,
            intents.c.epoch < before_epoch,
            intents.c.outcome == IntentOutcome.OPEN,
        )
        with self.db.begin(self.tx, read=True) as conn:
            return [IntentRow.from_row(row) for row in conn.execute(stmt)]

    def dead_letters(
        self,
        run_id: str | None = None,
        workflow: str | None = None,
        include_replayed: bool = True,
    ) -> list[DeadLetterRow]:
        stmt = select(dead_letters).order_by(dead_letters.c.id)
        if run_id is not None:
            stmt = stmt.where(dead_letters.c.run_id == run_id)
        if workflow is not None:
            stmt = stmt.where(dead_letters.c.workflow == workflow)
        if not include_replayed:
            stmt = stmt.where(dead_letters.c.replayed_at.is_(None))
        with self.db.begin(self.tx, read=True) as conn:
            return [DeadLetterRow.from_row(row) for row in conn.execute(stmt)]

    def dead_letter(self, letter_id: int) -> DeadLetterRow | None:
        stmt = select(dead_letters).where(dead_letters.c.id == letter_id)
        with self.db.begin(self.tx, read=True) as conn:
            return _first(DeadLetterRow, conn.execute(stmt))

    # --- transcripts ----------------------------------------------------------------

    def recorded(
        self, run_id: str, created_at: float, name: str, end: int | None = None
    ) -> Recorded:
        """Transcript ``name``'s recorded messages: those this process read before (the
        cache), then one read of the positions after them, up to ``end`` if given (a
        step's cursor: none at all when the cache holds that many already)."""
        cache = self.db.messages
        key = (run_id, created_at, name)
        have = cache.get(key)
        if end is not None and len(have) >= end:
            return have
        params: dict[str, Any] = {"b_run": run_id, "b_transcript": name, "b_pos": len(have)}
        stmt = transcripts.MESSAGES_FROM
        if end is not None:
            stmt, params["b_end"] = transcripts.BOUNDED, end
        with self.db.begin(self.tx, read=True) as conn:
            rows = conn.execute(stmt, params).all()
            if not rows:
                return have
            bodies = [body for body, _ in rows]
            grown = have.grown(transcripts.resolve_blobs(conn, bodies), [s for _, s in rows])
            after_commit(conn, lambda: cache.keep(key, have, grown))
        return grown

    def summary(self, run_id: str, created_at: float, step_id: str) -> str | None:
        """The recorded output of a compaction's summarize step once it is done (a done
        step's output never changes: kept per process); None while it is not."""
        cache = self.db.messages
        key = (run_id, created_at, step_id)
        text = cache.summary(key)
        if text is not None:
            return text
        with self.db.begin(self.tx, read=True) as conn:
            row = conn.execute(STEP_ROW, {"b_run": run_id, "b_step": step_id}).first()
            if row is None or row.status != StepStatus.DONE or row.output is None:
                return None
            (text,) = transcripts.resolve_blobs(conn, [row.output])
            after_commit(conn, lambda: cache.keep_summary(key, text))
        return text

    def transcript(self, run_id: str, name: str) -> tuple[list[Any], list[Any]]:
        """Every message row (pos, body, step_id, created_at; bodies resolved) and every
        compaction row (number, start, upto, base, step_id, status, output, created_at)
        of the transcript, in one transaction, uncached: what an operator reads."""
        params = {"b_run": run_id, "b_transcript": name}
        with self.db.begin(self.tx, read=True) as conn:
            found = _message_rows(conn, transcripts.WHOLE, params)
            return found, [tuple(r) for r in conn.execute(transcripts.COMPACTIONS, params).all()]

    def transcript_head(self, run_id: str, name: str) -> tuple[list[Any], int]:
        """Every compaction row of the transcript and how many messages it has: what a
        paged read (``transcript_page``) is told first."""
        params = {"b_run": run_id, "b_transcript": name}
        with self.db.begin(self.tx, read=True) as conn:
            comps = [tuple(r) for r in conn.execute(transcripts.COMPACTIONS, params).all()]
            return comps, int(conn.execute(transcripts.LENGTH, params).scalar_one())

    def transcript_page(self, run_id: str, name: str, start: int, limit: int) -> list[Any]:
        """``transcript``'s message rows from position ``start``, at most ``limit``: a
        long transcript read a page at a time, never held whole."""
        params = {"b_run": run_id, "b_transcript": name, "b_pos": start, "b_limit": limit}
        with self.db.begin(self.tx, read=True) as conn:
            return _message_rows(conn, transcripts.PAGE_FROM, params)

    def transcript_names(self, run_id: str) -> list[str]:
        with self.db.begin(self.tx, read=True) as conn:
            return sorted(conn.execute(transcripts.NAMES, {"b_run": run_id}).scalars())

    def blob(self, digest: str) -> str | None:
        with self.db.begin(self.tx, read=True) as conn:
            return conn.execute(select(blobs.c.body).where(blobs.c.digest == digest)).scalar()

    def figures(self, buckets: Sequence[float] = totals.DURATION_BUCKETS) -> Figures:
        """Fleet-wide figures for the metrics endpoint, all from the store, so they are
        right however many workers there are. The counts (attempts, incidents, dead
        letters, durations, spend) are the rows' plus what retention kept of the rows it
        deleted (fleet/store/totals.py), so they never go back; a bucket bound outside
        ``totals.DURATION_BUCKETS`` counts live rows only."""
        with self.db.begin(self.tx, read=True) as conn:
            dead_total, dead_open = conn.execute(_DEAD_LETTERS).one()
            hist = conn.execute(totals.durations(buckets)).one()
            kept = totals.pruned(conn)
            spend = {
                (w, m or ""): (int(i or 0), int(o or 0), float(c or 0.0))
                for w, m, i, o, c in conn.execute(totals.spend()).all()
            }
            figures = Figures(
                runs=_counts(conn, runs.c.status),
                attempts=_counts(conn, attempts.c.outcome),
                incidents=_counts(conn, incidents.c.kind),
                dead_letters=int(dead_total),
                dead_letters_outstanding=int(dead_open),
                waits_open=int(conn.execute(_WAITS_OPEN).scalar_one()),
                duration_buckets=[int(v) for v in hist[: len(buckets)]],
                duration_count=int(hist[len(buckets)]),
                duration_sum=float(hist[len(buckets) + 1]),
                spend=[],
                live_queues=list(conn.execute(_LIVE_QUEUES).scalars().all()),
            )
        return totals.with_pruned(figures, buckets, spend, kept)

    def now(self) -> float:
        with self.db.begin(self.tx, read=True) as conn:
            return float(conn.execute(select(db_now())).scalar_one())

    # --- dead messages: broker messages that were not fleet's -------------------------

    def dead_messages(self, limit: int = 100) -> list[DeadMessageInfo]:
        """The newest ``limit`` dead messages, newest first."""
        stmt = select(dead_messages).order_by(dead_messages.c.id.desc()).limit(limit)
        with self.db.begin(self.tx, read=True) as conn:
            return [DeadMessageInfo.from_row(row) for row in conn.execute(stmt)]

    def dead_message(self, message_id: int) -> DeadMessageInfo | None:
        stmt = select(dead_messages).where(dead_messages.c.id == message_id)
        with self.db.begin(self.tx, read=True) as conn:
            return _first(DeadMessageInfo, conn.execute(stmt))

    def dead_message_count(self) -> int:
        with self.db.begin(self.tx, read=True) as conn:
            return int(conn.execute(select(func.count()).select_from(dead_messages)).scalar_one())


def _message_rows(conn: Connection, stmt: Any, params: dict[str, Any]) -> list[Any]:
    """The message rows ``stmt`` reads: (pos, body, step_id, created_at), bodies resolved."""
    rows = conn.execute(stmt, params).all()
    bodies = transcripts.resolve_blobs(conn, [r.body for r in rows])
    return [(r.pos, body, r.step_id, r.created_at) for r, body in zip(rows, bodies, strict=True)]
