"""Reads. Nothing here writes; decisions are never taken on a read alone (the
ledger's conditional writes re-check every condition they depend on)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import case, func, select
from sqlalchemy.engine import Connection, Row

from fleet.store.engine import Database, db_now
from fleet.store.history import HistoryCache
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
from fleet.store.statements import HISTORY, HISTORY_AFTER, RUN_ROW, STEP_ROW


class Snapshot(NamedTuple):
    """A run row and its history, read in one transaction: what a replay needs."""

    run: Row[Any]
    history: Sequence[Row[Any]]


def read_snapshot(
    conn: Connection, run_id: str, cache: HistoryCache, run: Row[Any] | None = None
) -> Snapshot | None:
    """The run and its history, inside the caller's transaction: the finished rows this
    process read before from ``cache``, the rest from the store. ``run``: its row, if
    the caller has just read it in this transaction."""
    if run is None:
        run = conn.execute(RUN_ROW, {"b_run": run_id}).first()
    if run is None:
        return None
    # Keyed by the run's id and creation time: retention may delete a finished run and
    # the same id be enqueued again, and the new run must never see the old one's steps.
    key = f"{run_id}\x00{run.created_at!r}"
    prefix = cache.prefix(key)
    if prefix:
        tail = conn.execute(HISTORY_AFTER, {"b_run": run_id, "b_seq": prefix[-1].seq}).all()
    else:
        tail = conn.execute(HISTORY, {"b_run": run_id}).all()
    cache.extend(key, prefix, tail)
    return Snapshot(run, [*prefix, *tail])


class Queries:
    def __init__(self, db: Database) -> None:
        self.db = db

    def run(self, run_id: str) -> Row[Any] | None:
        with self.db.begin() as conn:
            return conn.execute(RUN_ROW, {"b_run": run_id}).first()

    def run_and_step(self, run_id: str, step_id: str) -> tuple[Row[Any] | None, Row[Any] | None]:
        """The run and one of its steps, in one transaction."""
        params = {"b_run": run_id, "b_step": step_id}
        with self.db.begin() as conn:
            run = conn.execute(RUN_ROW, params).first()
            step = conn.execute(STEP_ROW, params).first() if run else None
            return run, step

    def snapshot(self, run_id: str) -> Snapshot | None:
        with self.db.begin() as conn:
            return read_snapshot(conn, run_id, self.db.history)

    def runs(self, status: str | None = None, limit: int = 100) -> Sequence[Row[Any]]:
        stmt = select(runs).order_by(runs.c.created_at.desc()).limit(limit)
        if status:
            stmt = stmt.where(runs.c.status == status)
        with self.db.begin() as conn:
            return conn.execute(stmt).all()

    def steps(self, run_id: str) -> Sequence[Row[Any]]:
        with self.db.begin() as conn:
            return conn.execute(HISTORY, {"b_run": run_id}).all()

    def progress(self, run_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Per run: (task steps finished, task steps recorded)."""
        finished = func.sum(case((steps.c.status.in_(["done", "dead"]), 1), else_=0))
        stmt = (
            select(steps.c.run_id, finished, func.count())
            .where(steps.c.run_id.in_(list(run_ids)), steps.c.kind == "task")
            .group_by(steps.c.run_id)
        )
        with self.db.begin() as conn:
            return {r: (int(d or 0), int(n)) for r, d, n in conn.execute(stmt).all()}

    def step(self, run_id: str, step_id: str) -> Row[Any] | None:
        with self.db.begin() as conn:
            return conn.execute(STEP_ROW, {"b_run": run_id, "b_step": step_id}).first()

    def attempts(self, run_id: str) -> Sequence[Row[Any]]:
        with self.db.begin() as conn:
            return conn.execute(
                select(attempts)
                .where(attempts.c.run_id == run_id)
                .order_by(attempts.c.started_at, attempts.c.epoch)
            ).all()

    def usage(self, run_id: str) -> dict[str, Any]:
        with self.db.begin() as conn:
            row = conn.execute(
                select(
                    func.coalesce(func.sum(attempts.c.calls), 0),
                    func.coalesce(func.sum(attempts.c.input_tokens), 0),
                    func.coalesce(func.sum(attempts.c.output_tokens), 0),
                    func.coalesce(func.sum(attempts.c.cost), 0.0),
                ).where(attempts.c.run_id == run_id)
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
        with self.db.begin() as conn:
            return {kind: int(n) for kind, n in conn.execute(stmt).all()}

    def intents(self, run_id: str, step_id: str | None = None) -> Sequence[Row[Any]]:
        stmt = select(intents).where(intents.c.run_id == run_id)
        if step_id is not None:
            stmt = stmt.where(intents.c.step_id == step_id)
        with self.db.begin() as conn:
            return conn.execute(stmt.order_by(intents.c.step_id, intents.c.epoch)).all()

    def in_doubt(self, run_id: str, step_id: str, before_epoch: int) -> Sequence[Row[Any]]:
        """Intents of earlier attempts that never reported: they may have acted."""
        with self.db.begin() as conn:
            return conn.execute(
                select(intents).where(
                    intents.c.run_id == run_id,
                    intents.c.step_id == step_id,
                    intents.c.epoch < before_epoch,
                    intents.c.outcome == "open",
                )
            ).all()

    def dead_letters(
        self,
        run_id: str | None = None,
        workflow: str | None = None,
        include_replayed: bool = True,
    ) -> Sequence[Row[Any]]:
        stmt = select(dead_letters).order_by(dead_letters.c.id)
        if run_id is not None:
            stmt = stmt.where(dead_letters.c.run_id == run_id)
        if workflow is not None:
            stmt = stmt.where(dead_letters.c.workflow == workflow)
        if not include_replayed:
            stmt = stmt.where(dead_letters.c.replayed_at.is_(None))
        with self.db.begin() as conn:
            return conn.execute(stmt).all()

    def dead_letter(self, letter_id: int) -> Row[Any] | None:
        with self.db.begin() as conn:
            return conn.execute(select(dead_letters).where(dead_letters.c.id == letter_id)).first()

    def blob(self, digest: str) -> str | None:
        with self.db.begin() as conn:
            return conn.execute(select(blobs.c.body).where(blobs.c.digest == digest)).scalar()

    def figures(self, buckets: Sequence[float]) -> dict[str, Any]:
        """Fleet-wide figures for the metrics endpoint, all from the store, so they are
        right however many workers there are."""
        duration = attempts.c.finished_at - attempts.c.started_at
        finished = attempts.c.finished_at.is_not(None)
        with self.db.begin() as conn:
            runs_by_status: dict[str, int] = dict(
                conn.execute(select(runs.c.status, func.count()).group_by(runs.c.status)).all()
            )
            outcomes: dict[str, int] = dict(
                conn.execute(
                    select(attempts.c.outcome, func.count()).group_by(attempts.c.outcome)
                ).all()
            )
            incidents_by_kind: dict[str, int] = dict(
                conn.execute(
                    select(incidents.c.kind, func.count()).group_by(incidents.c.kind)
                ).all()
            )
            dead_total, dead_open = conn.execute(
                select(
                    func.count(),
                    func.coalesce(
                        func.sum(case((dead_letters.c.replayed_at.is_(None), 1), else_=0)), 0
                    ),
                )
            ).one()
            waits_open = conn.execute(
                select(func.count()).where(
                    steps.c.kind == "wait",
                    steps.c.status == "pending",
                    runs.c.id == steps.c.run_id,
                    runs.c.status.in_(["running", "waiting"]),
                )
            ).scalar_one()
            hist = conn.execute(
                select(
                    *[
                        func.coalesce(func.sum(case((duration <= b, 1), else_=0)), 0)
                        for b in buckets
                    ],
                    func.count(),
                    func.coalesce(func.sum(duration), 0.0),
                ).where(finished)
            ).one()
            spend = conn.execute(
                select(
                    runs.c.workflow,
                    attempts.c.model,
                    func.sum(attempts.c.input_tokens),
                    func.sum(attempts.c.output_tokens),
                    func.sum(attempts.c.cost),
                )
                .where(runs.c.id == attempts.c.run_id)
                .group_by(runs.c.workflow, attempts.c.model)
            ).all()
            live_queues = (
                conn.execute(
                    select(runs.c.queue)
                    .where(runs.c.status.in_(["queued", "running", "waiting"]))
                    .distinct()
                )
                .scalars()
                .all()
            )
        return {
            "runs": {str(k): int(v) for k, v in runs_by_status.items()},
            "attempts": {str(k): int(v) for k, v in outcomes.items()},
            "incidents": {str(k): int(v) for k, v in incidents_by_kind.items()},
            "dead_letters": int(dead_total),
            "dead_letters_outstanding": int(dead_open),
            "waits_open": int(waits_open),
            "duration_buckets": [int(v) for v in hist[: len(buckets)]],
            "duration_count": int(hist[len(buckets)]),
            "duration_sum": float(hist[len(buckets) + 1]),
            "spend": [
                (w, m or "", int(i or 0), int(o or 0), float(c or 0.0)) for w, m, i, o, c in spend
            ],
            "live_queues": list(live_queues),
        }

    def now(self) -> float:
        with self.db.begin() as conn:
            return float(conn.execute(select(db_now())).scalar_one())

    # --- dead messages: broker messages that were not fleet's -------------------------

    def dead_messages(self, limit: int = 100) -> Sequence[Row[Any]]:
        """The newest ``limit`` dead messages, newest first."""
        stmt = select(dead_messages).order_by(dead_messages.c.id.desc()).limit(limit)
        with self.db.begin() as conn:
            return conn.execute(stmt).all()

    def dead_message(self, message_id: int) -> Row[Any] | None:
        stmt = select(dead_messages).where(dead_messages.c.id == message_id)
        with self.db.begin() as conn:
            return conn.execute(stmt).first()

    def dead_message_count(self) -> int:
        with self.db.begin() as conn:
            return int(conn.execute(select(func.count()).select_from(dead_messages)).scalar_one())
