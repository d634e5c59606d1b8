"""Connections: one engine per process, SQLite tuned for several processes, the
database's clock, and driver errors translated at this boundary."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, Float, create_engine, event, inspect
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement

from fleet.errors import StoreUnavailable

log = logging.getLogger("fleet.store")

SQLITE_BUSY_TIMEOUT_MS = 30_000


class db_now(FunctionElement[float]):  # noqa: N801 - reads as a SQL function
    """Seconds since the epoch on the database's clock: one clock for the whole fleet."""

    type = Float()
    inherit_cache = True


@compiles(db_now, "postgresql")
def _pg_now(element: db_now, compiler: Any, **kw: Any) -> str:
    # clock_timestamp, not now(): now() is frozen at the start of the transaction.
    return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"


@compiles(db_now, "sqlite")
def _sqlite_now(element: db_now, compiler: Any, **kw: Any) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" below issue BEGIN itself (pysqlite's own is deferred).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # IMMEDIATE takes the write lock up front: a deferred transaction that later
        # needs to write fails with SQLITE_BUSY at once instead of waiting its turn.
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreUnavailable(
                    f"store {url} unavailable: cannot create its folder ({exc.strerror})"
                ) from exc
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
        _configure_sqlite(engine)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10)


class Database:
    """A lazily created engine that survives fork (Celery's prefork pool)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._engine: Engine | None = None
        self._pid = 0
        self._lock = threading.Lock()

    @property
    def engine(self) -> Engine:
        if self._engine is None or self._pid != os.getpid():
            with self._lock:
                if self._engine is not None and self._pid != os.getpid():
                    # Connections inherited from the parent are not ours to close.
                    self._engine.dispose(close=False)
                    self._engine = None
                if self._engine is None:
                    self._engine = make_engine(self.url)
                    self._pid = os.getpid()
        return self._engine

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """One transaction; driver errors come out as ``StoreUnavailable``."""
        try:
            with self.engine.begin() as conn:
                yield conn
        except OperationalError as exc:
            raise StoreUnavailable(describe_driver_error(self.url, exc)) from exc

    def has_schema(self) -> bool:
        try:
            with self.engine.connect() as conn:
                return inspect(conn).has_table("fleet_runs")
        except OperationalError as exc:
            raise StoreUnavailable(describe_driver_error(self.url, exc)) from exc

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable database URL>"


def describe_driver_error(url: str, exc: DBAPIError) -> str:
    first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
    return f"store {redact(url)} unavailable: {first}"
