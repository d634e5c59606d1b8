"""Connections: one engine per process, SQLite tuned for several processes, the
database's clock, and driver errors translated at this boundary.

Transactions are passed by hand: ``Database.begin()`` opens one for a single store
call; ``Database.transaction()`` opens one that several calls share, each given it
explicitly (``begin(tx)``). Nothing is joined through state held on the thread."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Engine, Float, create_engine, event, inspect, make_url
from sqlalchemy.engine import Connection
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    DisconnectionError,
    NoSuchModuleError,
    OperationalError,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement

from fleet.errors import BadInput, StoreUnavailable
from fleet.store import driver, waits
from fleet.store.history import HistoryCache
from fleet.store.message_cache import MessageCache

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


# In a connection's ``info`` while ``Database.begin(read=True)`` opens its transaction:
# SQLite's BEGIN then takes no write lock.
READING = "fleet.reading"


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
        # needs to write fails with SQLITE_BUSY at once instead of waiting its turn. A
        # read (``Database.begin(read=True)``) takes no lock at all: under WAL it reads
        # its snapshot beside the writer, so a reader frozen (SIGSTOP) or slow in it
        # never holds up another worker's writes.
        conn.exec_driver_sql("BEGIN" if conn.info.get(READING) else "BEGIN IMMEDIATE")


def parse_url(url: str) -> URL:
    """The database URL, or one line saying it is not one (never echoing it: an
    unparsable URL cannot be redacted and may hold a password)."""
    try:
        return make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        raise BadInput(
            "the database URL (FLEET_DATABASE_URL) cannot be parsed: expected "
            "sqlite:///PATH or postgresql+psycopg://USER:PASSWORD@HOST/NAME"
        ) from None


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL; None for another database or an in-memory one."""
    parsed = parse_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    name = parsed.database or ""
    if not name or name == ":memory:" or name.startswith("file:"):
        return None
    return Path(name)


# Postgres connections kept per process until the process says how many it runs at
# once (``Database.size_pool``), and opened beyond the pool at a peak (then closed).
POOL_SIZE = 5
POOL_OVERFLOW = 10
# A sized pool keeps this many more for the process's own threads (heartbeats, the
# async steps' loop) and opens none beyond: past it, tasks wait in the pool's queue
# for a connection rather than open one and close it again at every peak.
SIZED_HEADROOM = 5


def make_engine(url: str, pool_size: int | None = None) -> Engine:
    """The engine; on Postgres, a pool for ``pool_size`` tasks at once (None: the
    default pool, for a process that does not say), handed out most recently used
    first so that a large pool's idle tail is not pinged back to life on every checkout."""
    path = sqlite_path(url)
    if path is not None and not path.exists():
        _create_sqlite_file(url, path)
    try:
        if parse_url(url).get_backend_name() == "sqlite":
            engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
            _configure_sqlite(engine)
            return engine
        engine = create_engine(
            url,
            pool_size=POOL_SIZE if pool_size is None else pool_size + SIZED_HEADROOM,
            max_overflow=POOL_OVERFLOW if pool_size is None else 0,
            pool_use_lifo=pool_size is not None,
        )
    except (NoSuchModuleError, ImportError) as exc:
        raise BadInput(f"database URL {redact(url)} cannot be used: {exc}") from None
    _ping_idle_connections(engine)
    waits.cooperative(engine)  # on psycopg, a greenlet may wait its own way
    # A statement run through SQLAlchemy first sends what the driver left pending.
    event.listen(engine, "before_cursor_execute", driver.settle)
    event.listen(engine, "connect", driver.prepares_alone)
    return engine


def _create_sqlite_file(url: str, path: Path) -> None:
    """The embedded store's folder and file, readable by their owner only: the store
    holds every run's inputs and outputs. SQLite gives the -wal and -shm files it
    creates later the database file's mode."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    except OSError as exc:
        raise StoreUnavailable(
            f"store {redact(url)} unavailable: cannot create it ({exc.strerror})"
        ) from exc


# A pooled connection used less than this long ago is trusted without a ping.
PING_IDLE_SECONDS = 1.0


def _ping_idle_connections(engine: Engine) -> None:
    """Ping a connection on checkout only if it sat idle in the pool, not on every
    checkout as ``pool_pre_ping`` does: a busy worker's step would pay a round trip (a
    transaction, as Postgres counts it) for nothing. A connection that died while in
    use (a Postgres restart) fails its statement instead; SQLAlchemy then invalidates
    the whole pool, and the caller's transaction is retried or re-run as any store
    error is (a step's commit falls back to committing alone, a lease expires)."""

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.pop("idle_since", None)
        if idle_since is None or time.monotonic() - idle_since < PING_IDLE_SECONDS:
            return  # just connected, or in use a moment ago
        try:
            with dbapi_conn.cursor() as cur:
                cur.execute("SELECT 1")
            dbapi_conn.rollback()
        except Exception as exc:
            # The pool discards this connection and checks out (or opens) another.
            raise DisconnectionError(f"idle connection is gone: {exc}") from exc


class CommitUnknown(StoreUnavailable):
    """A transaction's COMMIT failed: whether it applied is unknown until the store is read."""


class Transaction:
    """One open transaction, handed by the caller to every store call that is to run in
    it (``Database.begin(tx)``, ``Ledger.within(tx)``): nothing joins it unasked.

    ``failed``: the first store call that failed in it. Once set, the transaction can
    only roll back, even if the caller caught the error and carried on."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.failed: BaseException | None = None
        self.open = True
        self.committed: list[Callable[[], None]] = []  # see ``after_commit``
        self.line: driver.Line | None = None  # its pipeline, on Postgres


def after_commit(conn: Connection, fn: Callable[[], None]) -> None:
    """Call ``fn`` once the transaction ``conn`` is in has committed; never if it rolls
    back or its COMMIT fails. What a process keeps of what it read (the history and
    message caches) is kept so: a read in a transaction sees that transaction's own
    writes, and those are facts only once it commits. (A connection opened outside
    ``Database``'s transactions has no such moment: ``fn`` is dropped.)"""
    try:
        tx = conn.info.get(driver.OPEN)
    except Exception:  # noqa: BLE001 - a connection the store dropped has no info
        return
    if tx is not None and tx.conn is conn and tx.open:
        tx.committed.append(fn)


def _forget(conn: Connection) -> None:
    """The connection's transaction has ended: its ``info`` no longer names it."""
    with suppress(Exception):  # a connection the store dropped has no info
        conn.info.pop(driver.OPEN, None)


def _run(committed: list[Callable[[], None]]) -> None:
    for fn in committed:
        fn()


class Database:
    """A lazily created engine that survives fork (Celery's prefork pool)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._engine: Engine | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._pool_size: int | None = None
        self.history = HistoryCache()
        self.messages = MessageCache()
        # Whether a call's own transaction goes on the wire as ``transaction``'s do.
        self._wired = parse_url(url).get_backend_name() == "postgresql"

    @property
    def engine(self) -> Engine:
        if self._engine is None or self._pid != os.getpid():
            with self._lock:
                if self._engine is not None and self._pid != os.getpid():
                    # Connections inherited from the parent are not ours to close.
                    self._engine.dispose(close=False)
                    self._engine = None
                if self._engine is None:
                    self._engine = make_engine(self.url, self._pool_size)
                    self._pid = os.getpid()
        return self._engine

    def size_pool(self, size: int) -> None:
        """Keep a connection per task for ``size`` tasks run at once in this process
        (Postgres), and ``SIZED_HEADROOM`` more, opening none beyond: a worker's
        threads or greenlets would otherwise open and close connections past the
        default pool at every peak. An engine already made is replaced (its idle
        connections closed; one in use is closed when given back)."""
        if size < 1:
            raise BadInput(f"a connection pool for {size} tasks cannot serve anyone")
        with self._lock:
            if size == self._pool_size:
                return
            self._pool_size = size
            if self._engine is not None and self._pid == os.getpid():
                self._engine.dispose()
                self._engine = None

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @property
    def cooperative(self) -> bool:
        """Its connections wait the way the calling greenlet says (fleet/store/waits.py)."""
        return waits.applies(self.engine)

    @property
    def wired(self) -> bool:
        """Postgres: a transaction's BEGIN and COMMIT are sent with its statements
        (fleet/store/driver.py), so a statement ``driver.send`` leaves pending goes out
        with the COMMIT of a call's own transaction too."""
        return self._wired

    @contextmanager
    def begin(self, tx: Transaction | None = None, *, read: bool = False) -> Iterator[Connection]:
        """A transaction of its own, committed on leaving; with ``tx``, a part of that
        one instead (committed or rolled back with it). ``read``: it only reads (on
        SQLite it then takes no write lock). Driver errors come out as
        ``StoreUnavailable``."""
        if tx is not None:
            with self._within(tx) as conn:
                yield conn
            return
        # On Postgres a call's own transaction is sent as ``transaction`` sends one: its
        # BEGIN with the first statements, its COMMIT with the last ones, so a single
        # write whose answer can wait is one round trip, not three.
        with self.transaction(read=read) as own, self._within(own) as conn:
            yield conn

    @contextmanager
    def _within(self, tx: Transaction) -> Iterator[Connection]:
        if not tx.open:
            raise RuntimeError("a store call in a transaction that has ended")
        if tx.failed is not None:
            raise StoreUnavailable(
                f"store call after a failed one in the same transaction: {tx.failed}"
            )
        try:
            yield tx.conn
        except OperationalError as exc:
            tx.failed = exc
            raise StoreUnavailable(describe_driver_error(self.url, exc)) from exc
        except Exception as exc:
            # Even if a caller swallows it, the transaction must not commit after this.
            tx.failed = exc
            raise

    @contextmanager
    def transaction(self, *, read: bool = False) -> Iterator[Transaction]:
        """One transaction for several store calls, each handed it by hand, so several
        conditional writes (and the reads between them) cost one round of BEGIN/COMMIT
        and land together or not at all. Commits on leaving. ``read``: as ``begin``'s.

        Errors: anything raised inside rolls it back and propagates (driver errors as
        ``StoreUnavailable``), as does a store call that failed in it even if its caller
        caught the error; a failed COMMIT raises ``CommitUnknown``."""
        try:
            conn = self.engine.connect()
        except OperationalError as exc:
            raise StoreUnavailable(describe_driver_error(self.url, exc)) from exc
        tx = Transaction(conn)
        try:
            try:
                conn.info[READING] = read  # for SQLite's BEGIN only
                try:
                    conn.begin()
                finally:
                    conn.info.pop(READING, None)
                # On Postgres fleet sends the BEGIN with the first statements and the
                # COMMIT with the last ones (fleet/store/driver.py).
                if self._wired:
                    tx.line = driver.own(conn)
                conn.info[driver.OPEN] = tx
                try:
                    yield tx
                finally:
                    tx.open = False
                    _forget(conn)
                if tx.failed is not None:
                    raise StoreUnavailable(f"a store call in the transaction failed: {tx.failed}")
            except BaseException:
                driver.abandon(tx.line)
                _quietly_rollback(conn)
                raise
            try:
                driver.finish(conn, tx.line)
                conn.commit()
            except OperationalError as exc:
                if not _rolled_back(exc):
                    raise CommitUnknown(describe_driver_error(self.url, exc)) from exc
                driver.abandon(tx.line)
                _quietly_rollback(conn)
                raise
            except BaseException:
                # Refused before the COMMIT ran (a statement sent with it failed).
                driver.abandon(tx.line)
                _quietly_rollback(conn)
                raise
            _run(tx.committed)
        except OperationalError as exc:
            raise StoreUnavailable(describe_driver_error(self.url, exc)) from exc
        finally:
            driver.release(conn, tx.line)
            conn.close()

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


def _rolled_back(exc: OperationalError) -> bool:
    """The server answered that it rolled the transaction back (SQLSTATE class 40: a
    serialization failure or a deadlock, in a statement sent with the COMMIT or in
    the COMMIT itself): known not to have committed. Any other operational error at
    the COMMIT (the connection lost, the server shutting down) leaves it unknown."""
    sqlstate = getattr(exc.orig, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate.startswith("40")


def _quietly_rollback(conn: Connection) -> None:
    try:
        conn.rollback()
    except Exception as exc:  # the connection is gone; the server rolls back itself
        log.debug("rollback of a failed transaction failed too: %s", exc)


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable database URL>"


def describe_driver_error(url: str, exc: DBAPIError) -> str:
    first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
    return f"store {redact(url)} unavailable: {first}"


# Postgres aborts one of two transactions that wait on each other (deadlock_detected),
# or a serializable one that conflicted; the transaction may simply be tried again.
RETRYABLE_SQLSTATES = frozenset({"40P01", "40001"})


def retryable(exc: BaseException) -> bool:
    """A store error that rolled its transaction back and may be retried as it was:
    a deadlock Postgres broke by aborting this side, or a serialization failure."""
    cause = exc.__cause__
    orig = getattr(cause, "orig", None)
    return isinstance(cause, DBAPIError) and getattr(orig, "sqlstate", None) in RETRYABLE_SQLSTATES
