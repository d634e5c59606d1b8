"""A replay's reads: the run's row and its history, read in one transaction, the
finished rows this process has read before taken from its history cache
(``fleet/store/history.py``) and only the rows after them read from the store."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any, NamedTuple

from sqlalchemy import select
from sqlalchemy.engine import Connection, Row

from fleet.store import driver
from fleet.store.engine import Database, after_commit
from fleet.store.history import HistoryCache
from fleet.store.predicates import RUN, SEQ
from fleet.store.rows import RunRow, StepRow
from fleet.store.schema import runs, steps

# A replay's reads, built once: they run once per step.
RUN_ROW = select(runs).where(runs.c.id == RUN)
HISTORY = select(steps).where(steps.c.run_id == RUN).order_by(steps.c.seq)
# The history after the rows a process has cached (see fleet/store/history.py).
HISTORY_AFTER = HISTORY.where(steps.c.seq > SEQ)


class Snapshot(NamedTuple):
    """A run row and its history, read in one transaction: what a replay needs."""

    run: RunRow
    history: Sequence[StepRow]


def read_snapshot(
    conn: Connection, run_id: str, cache: HistoryCache, run: Row[Any] | None = None
) -> Snapshot | None:
    """The run and its history, inside the caller's transaction: the finished rows this
    process read before from ``cache``, the rest from the store. ``run``: its row, if
    the caller has just read it in this transaction."""
    if run is None:
        run = driver.run(conn, RUN_ROW, {"b_run": run_id}).first()
    if run is None:
        return None
    row = RunRow.from_row(run)
    read = HistoryRead.of(run_id, row.created_at, cache)
    return read.snapshot(conn, row, driver.run(conn, read.stmt, read.params))


class HistoryRead(NamedTuple):
    """The read of a run's history after the rows this process has cached of it (none
    cached: all of it), which a caller may send before it has the run's row."""

    cache: HistoryCache
    key: str
    prefix: tuple[StepRow, ...]
    stmt: Any
    params: dict[str, Any]

    @classmethod
    def of(cls, run_id: str, created_at: float, cache: HistoryCache) -> HistoryRead:
        # Keyed by the run's id and creation time: retention may delete a finished run
        # and the same id be enqueued again, and the new run must never see the old
        # one's steps.
        return cls._keyed(run_id, f"{run_id}\x00{created_at!r}", cache)

    @classmethod
    def guess(cls, run_id: str, cache: HistoryCache) -> HistoryRead:
        """The read for the run of this id the cache last kept rows of (none kept: the
        whole history), sent before the run's row tells its creation time; ``made_for``
        that row says whether the guess was right."""
        return cls._keyed(run_id, cache.key_of(run_id) or "", cache)

    def made_for(self, run: RunRow) -> HistoryRead | None:
        """This read, for ``run`` (its row, read with it); None if it was made for
        another run of that id (guessed from what the cache kept) and must be made again."""
        key = f"{run.id}\x00{run.created_at!r}"
        if self.key == key:
            return self
        return self._replace(key=key) if not self.key else None

    @classmethod
    def _keyed(cls, run_id: str, key: str, cache: HistoryCache) -> HistoryRead:
        prefix = cache.prefix(key) if key else ()
        if prefix:
            after = {"b_run": run_id, "b_seq": prefix[-1].seq}
            return cls(cache, key, prefix, HISTORY_AFTER, after)
        return cls(cache, key, prefix, HISTORY, {"b_run": run_id})

    def snapshot(self, conn: Connection, run: RunRow, rows: Any) -> Snapshot:
        """The snapshot of ``run`` (the run this read was made for) from the rows the
        read returned; the cache learns them once the transaction commits."""
        tail = [StepRow.from_row(row) for row in rows]
        cache, key, prefix = self.cache, self.key, self.prefix
        after_commit(conn, lambda: cache.extend(key, prefix, tail))
        return Snapshot(run, [*prefix, *tail])


class Again(Enum):
    """What ``snapshot_at_once`` answers when it guessed another run of that id."""

    AGAIN = "again"


AGAIN = Again.AGAIN


def snapshot_at_once(db: Database, run_id: str) -> Snapshot | Again | None:
    """The run and its history in a transaction of their own whose BEGIN, both reads
    and COMMIT go to Postgres together (one round trip), the history read made for the
    run of this id the cache knows (``HistoryRead.guess``); ``AGAIN`` if it guessed
    another one. Elsewhere the two reads, one after the other, in one transaction."""
    cache = db.history
    with db.begin(read=True) as conn:
        guess = HistoryRead.guess(run_id, cache)
        run = driver.send(conn, RUN_ROW, {"b_run": run_id})
        rows = driver.send(conn, guess.stmt, guess.params)
        driver.commit_sent(conn)
        found = run.rows().first()
        if found is None:
            return None
        row = RunRow.from_row(found)
        read = guess.made_for(row)
        if read is None:
            return AGAIN
        return read.snapshot(conn, row, rows.rows())
