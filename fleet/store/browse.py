"""What the operator's console reads (``fleet/console``): pages of runs, the approval
inbox, in-doubt steps, the audit, workers, incidents by time bucket, and the cheap
fingerprints its live views poll to learn whether anything changed. Reads only.

The run list is keyset-paged on ``(created_at, id)``, newest first, so a deep page
costs what the first one does: each filter (status, workflow, tenant) has an index
led by it and followed by ``(created_at, id)`` (``fleet/store/schema.py``). A page's
progress and spend are read for that page's runs only, in one grouped query each; the
list's statements are built in ``fleet/store/run_list.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Float, Integer, cast, func, literal_column, select, text, true
from sqlalchemy.engine import Connection

from fleet.errors import BadInput
from fleet.states import RunStatus, StepKind, StepStatus
from fleet.store import messages as transcripts
from fleet.store.engine import Database
from fleet.store.predicates import now
from fleet.store.rows import DeadLetterRow
from fleet.store.run_list import (
    EVERY_RUN,
    LISTED,
    MAX_PAGE,
    RunFilter,
    encode_cursor,
    filters,
    listed,
    progress,
    spend,
    step_marks,
)
from fleet.store.schema import attempts, audit, dead_letters, incidents, runs, steps

_NO_JIT = text("SET LOCAL jit = off")
_COLLATION = text("SELECT datcollate FROM pg_database WHERE datname = current_database()")
LIVE = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING, RunStatus.NEEDS_DECISION)


@dataclass(frozen=True)
class RunListRow:
    """One run in the list. ``tokens`` and ``cost``: its spend and its child runs'."""

    id: str
    workflow: str
    version: str
    tenant: str | None
    status: str
    created_at: float
    updated_at: float
    finished_at: float | None
    parent_id: str | None
    steps_done: int
    steps_total: int
    tokens: int
    cost: float


@dataclass(frozen=True)
class RunsPage:
    """A page of runs; ``next`` the cursor of the page after it (None: the last one)."""

    rows: list[RunListRow]
    next: str | None


@dataclass(frozen=True)
class WaitRow:
    """A run waiting on ``wf.wait_for(name)`` since ``since``, until ``timeout_at`` (None:
    no timeout)."""

    run_id: str
    workflow: str
    tenant: str | None
    name: str
    since: float
    timeout_at: float | None
    wait_id: str = ""  # the wait's step id: a decision answers this wait only


@dataclass(frozen=True)
class AuditRow:
    """An operator's action (``fleet/store/audit.py``); ``detail`` decoded from JSON."""

    id: int
    at: float
    actor: str
    action: str
    run_id: str | None
    target: str | None
    why: str | None
    detail: dict[str, Any] | None


@dataclass(frozen=True)
class LettersPage:
    """The newest dead letters matching a filter, and how many match in all
    (``total``) and are not replayed yet (``outstanding``)."""

    rows: list[DeadLetterRow]
    total: int
    outstanding: int


@dataclass(frozen=True)
class WorkerRow:
    """A worker (its lease owner name) and the steps it holds a live lease on:
    ``(run id, step id, lease expires at)``."""

    worker: str
    running: list[tuple[str, str, float]]


@dataclass(frozen=True)
class TranscriptPage:
    """A page of transcript ``name``, newest first: ``messages`` before a position as
    ``(pos, body, step id, at)`` (bodies JSON text, blobs resolved); the transcript's
    ``length`` and number of ``compactions``, and the ``current`` one (the latest done:
    ``(number, start, upto, base, step id, status, output, at)``) or None."""

    name: str
    length: int
    messages: list[tuple[int, str, str | None, float]]
    compactions: int
    current: tuple[Any, ...] | None


def _digest(rows: Sequence[Any]) -> str:
    return hashlib.sha1(repr([tuple(r) for r in rows]).encode()).hexdigest()[:16]


class Browse:
    """The console's reads, each in one short transaction of its own."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._ordered: bool | None = None

    def _bytewise(self, conn: Connection) -> bool:
        """Whether ids sort by code point: SQLite, or Postgres with a C collation."""
        if self._ordered is None:
            sqlite = conn.dialect.name == "sqlite"
            c = "C" if sqlite else str(conn.execute(_COLLATION).scalar_one())
            self._ordered = c in ("C", "POSIX") or c.startswith("C.")
        return self._ordered

    @contextmanager
    def _begin(self, no_jit: bool = True) -> Iterator[Connection]:
        """A read's transaction. On Postgres without JIT: these are index lookups that
        run in a millisecond, and its estimate of a recursive CTE's size would have it
        compile them for ~20 ms each (jit_above_cost). ``no_jit=False`` spares that
        statement for the fingerprints the live views poll every second: their plans
        cost far below jit_above_cost (30 and 550-6,700 at 1,000,000 runs, against
        100,000), so JIT never starts for them anyway."""
        with self.db.begin(read=True) as conn:
            if no_jit and conn.dialect.name == "postgresql":
                conn.execute(_NO_JIT)
            yield conn

    # --- the run list -------------------------------------------------------------

    def runs_page(
        self, where: RunFilter = EVERY_RUN, after: str | None = None, limit: int = 50
    ) -> RunsPage:
        """The runs ``where`` lets through, newest first (``created_at``, then id), at
        most ``limit``, after the cursor ``after`` (a page's ``next``)."""
        with self._begin() as conn:
            ordered = self._bytewise(conn)
            clauses = filters(where, ordered)
            found = conn.execute(listed(clauses, after, limit, *LISTED, more=1)).mappings().all()
            page = found[:limit]
            ids = [r["id"] for r in page]
            steps_of, spend_of = progress(conn, ids), spend(conn, ids)
        rows = []
        for r in page:
            done, total = steps_of.get(r["id"], (0, 0))
            tokens, cost = spend_of.get(r["id"], (0, 0.0))
            rows.append(
                RunListRow(**r, steps_done=done, steps_total=total, tokens=tokens, cost=cost)
            )
        more = len(found) > limit
        cursor = encode_cursor(page[-1]["created_at"], page[-1]["id"]) if more else None
        return RunsPage(rows, cursor)

    def runs_fingerprint(
        self, where: RunFilter = EVERY_RUN, after: str | None = None, limit: int = 50
    ) -> str:
        """A short text that changes when the page ``runs_page`` would list with the
        same arguments changes: a run comes or goes, moves, is woken, or one of its
        steps is leased, settles or changes status. One query."""
        cols = (runs.c.id, runs.c.status, runs.c.updated_at, runs.c.wake_seq)
        with self._begin(no_jit=False) as conn:
            ordered = self._bytewise(conn)
            clauses = filters(where, ordered)
            page = listed(clauses, after, limit, *cols).subquery("page")
            stmt = (
                select(*page.c, *step_marks())
                .select_from(page.outerjoin(steps, steps.c.run_id == page.c.id))
                .group_by(*page.c)
                .order_by(page.c.id)
            )
            return _digest(conn.execute(stmt).all())

    def run_fingerprint(self, run_id: str) -> str | None:
        """A short text that changes when the run or any of its steps or attempts
        changes (None: no such run). One query."""
        marks = select(*step_marks()).where(steps.c.run_id == run_id).subquery("marks")
        spent = (
            select(
                func.count(),
                func.coalesce(func.sum(attempts.c.input_tokens + attempts.c.output_tokens), 0),
                func.max(attempts.c.finished_at),
            )
            .where(attempts.c.run_id == run_id)
            .subquery("spent")
        )
        stmt = (
            select(
                runs.c.status,
                runs.c.updated_at,
                runs.c.wake_seq,
                runs.c.advanced_seq,
                runs.c.finished_at,
                marks,
                spent,
            )
            .select_from(runs.join(marks, true()).join(spent, true()))
            .where(runs.c.id == run_id)
        )
        with self._begin(no_jit=False) as conn:
            row = conn.execute(stmt).first()
        return None if row is None else _digest([row])

    # --- what waits for a person -----------------------------------------------------

    def waiting_on_signal(self, limit: int = 200) -> list[WaitRow]:
        """Runs waiting on ``wf.wait_for(name)`` (status waiting, the wait's step
        pending), longest waiting first; the approval inbox."""
        stmt = (
            select(
                runs.c.id,
                runs.c.workflow,
                runs.c.tenant,
                steps.c.name,
                steps.c.created_at,
                steps.c.due_at,
                steps.c.step_id,
            )
            .select_from(runs.join(steps, steps.c.run_id == runs.c.id))
            .where(
                runs.c.status == RunStatus.WAITING,
                steps.c.kind == StepKind.WAIT,
                steps.c.status == StepStatus.PENDING,
                steps.c.name.like("wait:%"),
            )
            .order_by(steps.c.created_at, runs.c.id, steps.c.seq)
            .limit(limit)
        )
        with self._begin() as conn:
            found = conn.execute(stmt).all()
        return [
            WaitRow(rid, wf, tenant, name[len("wait:") :], since, due, wait_id)
            for rid, wf, tenant, name, since, due, wait_id in found
        ]

    def in_doubt(self, run_id: str) -> list[str]:
        """The ids of the run's steps in doubt (an effect a person must resolve)."""
        stmt = (
            select(steps.c.step_id)
            .where(steps.c.run_id == run_id, steps.c.status == StepStatus.IN_DOUBT)
            .order_by(steps.c.seq)
        )
        with self._begin() as conn:
            return list(conn.execute(stmt).scalars())

    # --- transcripts ---------------------------------------------------------------

    def transcript_names(self, run_id: str, limit: int = 20) -> list[str]:
        """The first ``limit`` names of the run's transcripts, in order."""
        with self._begin() as conn:
            return list(conn.execute(transcripts.names_of(limit), {"b_run": run_id}).scalars())

    def transcript_page(
        self, run_id: str, name: str, before: int | None = None, limit: int = 50
    ) -> TranscriptPage:
        """At most ``limit`` messages of the transcript before position ``before`` (None:
        the newest), newest first. Index ranges only: a page of a transcript of 20,000
        messages costs what one of 20 does."""
        if not 1 <= limit <= MAX_PAGE:
            raise BadInput(f"limit must be 1-{MAX_PAGE}, got {limit}")
        params = {"b_run": run_id, "b_transcript": name}
        with self._begin() as conn:
            length = int(conn.execute(transcripts.LENGTH, params).scalar_one())
            end = length if before is None else max(0, min(before, length))
            rows = conn.execute(transcripts.PAGE, {**params, "b_before": end, "b_limit": limit})
            found = rows.all()
            bodies = transcripts.resolve_blobs(conn, [r.body for r in found])
            count = int(conn.execute(transcripts.COMPACTION_COUNT, params).scalar_one())
            current = conn.execute(transcripts.CURRENT, params).first()
        messages = [
            (r.pos, body, r.step_id, r.created_at) for r, body in zip(found, bodies, strict=True)
        ]
        mark = None if current is None else tuple(current)
        return TranscriptPage(name, length, messages, count, mark)

    # --- the audit, the fleet ------------------------------------------------------------

    def audit(self, run_id: str | None = None, limit: int = 200) -> list[AuditRow]:
        """Operators' actions, newest first; with ``run_id``, those on that run."""
        stmt = select(audit).order_by(audit.c.at.desc(), audit.c.id.desc()).limit(limit)
        if run_id is not None:
            stmt = stmt.where(audit.c.run_id == run_id)
        with self._begin() as conn:
            found = conn.execute(stmt).mappings().all()
        decode = json.loads
        return [AuditRow(**{**r, "detail": r["detail"] and decode(r["detail"])}) for r in found]

    def dead_letters(
        self, run_id: str | None = None, workflow: str | None = None, limit: int = 200
    ) -> LettersPage:
        """Dead letters (replayed ones too) of run ``run_id`` / workflow ``workflow``
        when given, newest first, at most ``limit``; with the counts of all matching."""
        if not 1 <= limit <= 10_000:
            raise BadInput(f"limit must be between 1 and 10000, got {limit}")
        where = []
        if run_id is not None:
            where.append(dead_letters.c.run_id == run_id)
        if workflow is not None:
            where.append(dead_letters.c.workflow == workflow)
        newest = select(dead_letters).where(*where).order_by(dead_letters.c.id.desc())
        counts = select(
            func.count(), func.count().filter(dead_letters.c.replayed_at.is_(None))
        ).where(*where)
        with self._begin() as conn:
            found = conn.execute(newest.limit(limit)).all()
            total, outstanding = conn.execute(counts).one()
        return LettersPage([DeadLetterRow.from_row(r) for r in found], total, outstanding)

    def workers(self) -> list[WorkerRow]:
        """Workers holding a live lease (by the store's clock), each with its steps."""
        stmt = (
            select(steps.c.lease_owner, steps.c.run_id, steps.c.step_id, steps.c.lease_expires_at)
            .where(
                steps.c.status == StepStatus.RUNNING,
                steps.c.lease_owner.is_not(None),
                steps.c.lease_expires_at > now(),
            )
            .order_by(steps.c.lease_owner, steps.c.run_id, steps.c.step_id)
        )
        held: dict[str, list[tuple[str, str, float]]] = {}
        with self._begin() as conn:
            for owner, run_id, step_id, expires in conn.execute(stmt).all():
                held.setdefault(owner, []).append((run_id, step_id, expires))
        return [WorkerRow(owner, running) for owner, running in held.items()]

    def incidents_by_bucket(
        self, since: float, bucket_seconds: float
    ) -> list[tuple[float, str, int]]:
        """Incidents at or after ``since`` (epoch seconds), counted per kind per time
        bucket of ``bucket_seconds``: ``(bucket start, kind, count)``, oldest first.
        Buckets are aligned on the clock (multiples of ``bucket_seconds`` since the
        epoch: 00:45, 00:50 for five minutes), whatever ``since`` is; the first may hold
        only its part after ``since``."""
        if not bucket_seconds > 0:
            raise BadInput(f"bucket_seconds must be above 0, got {bucket_seconds}")
        with self._begin() as conn:
            # Grouped by the label: Postgres would not match two copies of the
            # expression, each with parameters of its own.
            bucket = _bucket(conn, bucket_seconds).label("bucket")
            stmt = (
                select(bucket, incidents.c.kind, func.count())
                .where(incidents.c.at >= since)
                .group_by(literal_column("bucket"), incidents.c.kind)
                .order_by(literal_column("bucket"), incidents.c.kind)
            )
            found = conn.execute(stmt).all()
        return [(int(b) * bucket_seconds, kind, int(n)) for b, kind, n in found]

    def queue_names(self) -> list[str]:
        """The queues live runs are on (their depth is the broker's to tell). It reads
        every live run: the console's /fleet lists the app's registered queues instead."""
        stmt = select(runs.c.queue).where(runs.c.status.in_(LIVE)).distinct()
        with self._begin() as conn:
            return sorted(conn.execute(stmt).scalars())

    def now(self) -> float:
        """The store's clock (the console's "ago" and "since" are measured on it)."""
        with self._begin() as conn:
            return float(conn.execute(select(now())).scalar_one())


def _bucket(conn: Connection, seconds: float) -> Any:
    """The number of the ``seconds``-long bucket since the epoch an incident falls in."""
    number = incidents.c.at / cast(seconds, Float)
    if conn.dialect.name == "postgresql":
        return cast(func.floor(number), Integer)
    return cast(number, Integer)  # SQLite's CAST truncates; times here are >= 0
