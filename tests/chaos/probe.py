"""What the chaos harness reads from the store while the faults strike: how many runs
are unfinished, whether a frozen step has been taken over, how a zombie attempt ended.
Read-only, and every read answers None while the store is unreachable (the injector
restarts Postgres): the caller asks again."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from sqlalchemy import Connection, text

from fleet import Fleet
from tests.chaos.faults import Body

# An attempt in these outcomes has not reported: it is running, or a takeover marked
# it lost. Its own commit or retry, applied or fenced, closes it with another outcome.
UNREPORTED = frozenset({"running", "lost"})

T = TypeVar("T")


def _sqlite_write_locked(path: str) -> int | None:
    """1 if another connection holds the write lock of the SQLite file, else 0 (None:
    the file could not be read)."""
    try:
        conn = sqlite3.connect(path, timeout=0.05, isolation_level=None)
    except sqlite3.Error:
        return None
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return 0
    except sqlite3.OperationalError:
        return 1
    finally:
        conn.close()


class StoreProbe:
    def __init__(self, client: Fleet) -> None:
        self.client = client

    def _read(self, read: Callable[[Connection], T]) -> T | None:
        try:
            with self.client.runtime.db.engine.connect() as conn:
                return read(conn)
        except Exception:  # Postgres restarting: the caller asks again
            return None

    def unfinished(self) -> int | None:
        """Runs not yet in a final state."""
        return self._read(
            lambda conn: int(
                conn.execute(
                    text(
                        "SELECT count(*) FROM fleet_runs "
                        "WHERE status NOT IN ('succeeded', 'failed', 'cancelled')"
                    )
                ).scalar_one()
            )
        )

    def running(self, limit: int) -> list[tuple[str, str]] | None:
        """Up to ``limit`` runs that are running, with their queues (id, queue)."""
        return self._read(
            lambda conn: [
                (str(r[0]), str(r[1]))
                for r in conn.execute(
                    text("SELECT id, queue FROM fleet_runs WHERE status = 'running' LIMIT :n"),
                    {"n": limit},
                )
            ]
        )

    def in_transaction(self, application_name: str) -> int | None:
        """Postgres sessions of the process named ``application_name`` (its PGAPPNAME)
        that are not idle: inside a transaction, holding whatever rows it has written
        locked until it commits. On SQLite, whether any process holds the file's write
        lock (1) or not (0): a process stopped holding it stops every writer."""
        engine = self.client.runtime.db.engine
        if engine.dialect.name == "sqlite":
            return _sqlite_write_locked(str(engine.url.database))
        return self._read(
            lambda conn: int(
                conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE application_name = :name AND state <> 'idle'"
                    ),
                    {"name": application_name},
                ).scalar_one()
            )
        )

    def taken_over(self, bodies: Iterable[Body]) -> set[Body] | None:
        """Those of ``bodies`` whose step a newer attempt has taken since: the store's
        epoch for the step is past theirs, so whatever they write now must be fenced."""

        def read(conn: Connection) -> set[Body]:
            out: set[Body] = set()
            for run_id, step_id, epoch in set(bodies):
                now = conn.execute(
                    text("SELECT epoch FROM fleet_steps WHERE run_id = :r AND step_id = :s"),
                    {"r": run_id, "s": step_id},
                ).scalar()
                if now is not None and int(now) > epoch:
                    out.add((run_id, step_id, epoch))
            return out

        return self._read(read)

    def outcomes(self, bodies: Iterable[Body]) -> dict[Body, str] | None:
        """The store's outcome of each of these attempts (running, lost, done, fenced…)."""

        def read(conn: Connection) -> dict[Body, str]:
            out: dict[Body, str] = {}
            for run_id, step_id, epoch in set(bodies):
                outcome: Any = conn.execute(
                    text(
                        "SELECT outcome FROM fleet_attempts "
                        "WHERE run_id = :r AND step_id = :s AND epoch = :e"
                    ),
                    {"r": run_id, "s": step_id, "e": epoch},
                ).scalar()
                out[(run_id, step_id, epoch)] = str(outcome) if outcome is not None else "missing"
            return out

        return self._read(read)
