"""Statements sent together on Postgres (psycopg's pipeline mode), and the BEGIN and
COMMIT of a ``Database.transaction`` sent by fleet with them.

psycopg, left to begin a transaction, sends its BEGIN and waits for it on a round trip
of its own, pipeline or not. In a transaction ``own_transaction`` took, the connection
is in psycopg's autocommit and fleet sends the BEGIN itself, with the first statements;
a statement ``send_all`` leaves in the open pipeline goes out with the next ``sync``,
which may be the COMMIT's (``finish``). A statement that is not the driver's (anything
run through SQLAlchemy) first syncs what is pending (``settle``, a listener on every
Postgres engine), so statements run in the order they were given, as ever. ``release``
hands the connection back to psycopg's own transactions (or invalidates it), so no
connection leaves a transaction in autocommit.

Also the driver's result type, ``Rows``. The statements themselves are compiled and
bound by ``fleet/store/driver.py``, the only caller.
"""

from __future__ import annotations

import logging
from collections import namedtuple
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Connection

if TYPE_CHECKING:
    from fleet.store.driver import Compiled, Params

log = logging.getLogger("fleet.store")


class Rows:
    """What ``run`` returns: the rows (named tuples: by position or by column name) and
    the count of rows a write touched."""

    __slots__ = ("rowcount", "_rows")

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def first(self) -> Any:
        return self._rows[0] if self._rows else None

    def all(self) -> list[Any]:
        return self._rows

    def scalar_one(self) -> Any:
        if len(self._rows) != 1:
            raise LookupError(f"expected one row, got {len(self._rows)}")
        return self._rows[0][0]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)


_ROW_TYPES: dict[tuple[str, ...], Any] = {}


def _row_type(columns: tuple[str, ...]) -> Any:
    made = _ROW_TYPES.get(columns)
    if made is None:
        made = namedtuple("Row", columns, rename=True)  # type: ignore[misc,no-redef]
        _ROW_TYPES[columns] = made
    return made


class _Wire:
    """What fleet holds of one transaction's connection: whether its BEGIN is still to
    be sent, and the pipeline ``send`` left open, with the statements in it."""

    __slots__ = ("begin", "dbapi", "pipeline", "pending", "driving")

    def __init__(self, dbapi: Any) -> None:
        self.dbapi = dbapi
        self.begin = True
        self.pipeline: Any = None
        self.pending: list[Pending] = []
        self.driving = False  # the driver is dispatching SQLAlchemy's listeners itself


_WIRES: dict[int, _Wire] = {}  # by id(conn), for the transactions fleet begins itself


def of(conn: Connection) -> _Wire | None:
    """The wire of ``conn``'s transaction, if fleet holds it."""
    return _WIRES.get(id(conn))


def held(conn: Connection) -> _Wire | None:
    """The wire of ``conn``'s transaction, if fleet holds it and something is to go out
    before the next statement (the BEGIN, or statements left pending)."""
    wire = _WIRES.get(id(conn))
    if wire is None or wire.driving or not (wire.begin or wire.pipeline is not None):
        return None
    return wire


def new_wire(dbapi: Any) -> _Wire:
    """A wire for one pipeline of statements outside a transaction fleet holds."""
    wire = _Wire(dbapi)
    wire.begin = False
    return wire


_BEGIN, _COMMIT = "BEGIN", "COMMIT"


class Pending:
    """A statement sent and not yet read: ``rows()`` syncs its pipeline if need be."""

    __slots__ = ("conn", "how", "cursor", "result")

    def __init__(self, conn: Connection, how: Compiled | None, cursor: Any) -> None:
        self.conn, self.how, self.cursor = conn, how, cursor
        self.result: Rows | None = None

    def rows(self) -> Rows:
        if self.result is None:
            wire = _WIRES.get(id(self.conn))
            if wire is not None and wire.pipeline is not None:
                sync(self.conn, wire)
            self._read()
        assert self.result is not None
        return self.result

    def _read(self) -> None:
        assert self.how is not None
        try:
            self.result = rows_of(self.cursor, self.how.columns)
        finally:
            self.cursor.close()


def rows_of(cursor: Any, columns: tuple[str, ...]) -> Rows:
    """What a statement executed on ``cursor`` returned: its rows as named tuples of
    ``columns`` (none read if it names none) and the count of rows it touched."""
    rows = list(cursor.fetchall()) if columns else []
    if rows:
        make = _row_type(columns)
        rows = [make(*row) for row in rows]
    return Rows(rows, cursor.rowcount)


def own_transaction(conn: Connection) -> bool:
    """Have fleet send the BEGIN and COMMIT of ``conn``'s transaction, just begun and
    nothing run in it yet (the module docstring); False where it cannot (no pipeline, or a
    transaction that needs more than a plain BEGIN). ``release`` ends it."""
    try:
        dbapi: Any = conn.connection.dbapi_connection
        plain = (dbapi.isolation_level, dbapi.read_only, dbapi.deferrable) == (None,) * 3
        idle = dbapi.pgconn.transaction_status == 0  # psycopg.pq.TransactionStatus.IDLE
        if not (plain and idle and not dbapi.autocommit and pipelines(dbapi)):
            return False
        dbapi.autocommit = True  # psycopg sends no BEGIN of its own
    except AttributeError:
        return False  # not psycopg
    _WIRES[id(conn)] = _Wire(dbapi)
    return True


def release(conn: Connection) -> None:
    """The transaction has ended (committed or rolled back): the connection goes back
    to psycopg's own transactions, or is invalidated if it cannot."""
    wire = _WIRES.pop(id(conn), None)
    if wire is None:
        return
    try:
        if wire.pipeline is not None:
            _close_quietly(wire)
        if wire.dbapi.pgconn.transaction_status == 0:
            wire.dbapi.autocommit = False
            return
    except Exception as exc:  # noqa: BLE001 - the connection is not fit for the pool
        log.debug("connection given up after its transaction: %s", exc)
    try:
        conn.invalidate()
    except Exception as exc:  # noqa: BLE001 - never hide the transaction's own error
        log.debug("connection could not be invalidated: %s", exc)


_PIPELINES: list[bool] = []  # whether this process's libpq has pipeline mode, once known


def pipelines(dbapi: Any) -> bool:
    """Whether statements can be sent together on this DBAPI connection: psycopg's,
    with a libpq that has pipeline mode (14 or later)."""
    if not hasattr(dbapi, "pipeline"):
        return False
    if not _PIPELINES:
        from psycopg import capabilities

        _PIPELINES.append(capabilities.has_pipeline())
    return _PIPELINES[0]


def abandon(conn: Connection) -> None:
    """The transaction failed: close any open pipeline, ignoring what it raises, so the
    rollback can be sent."""
    wire = _WIRES.get(id(conn))
    if wire is not None and wire.pipeline is not None:
        _close_quietly(wire)


def _close_quietly(wire: _Wire) -> None:
    pipeline, wire.pipeline = wire.pipeline, None
    pending, wire.pending = wire.pending, []
    try:
        pipeline.__exit__(None, None, None)
    except Exception as exc:  # noqa: BLE001 - the caller rolls back or gives it up
        log.debug("pipeline closed with an error: %s", exc)
    for p in pending:
        p.cursor.close()


def settle(conn: Connection, *_: Any) -> None:
    """Before a statement that is not the driver's: send the BEGIN if it has not gone,
    and sync whatever ``send`` left pending. (A ``before_cursor_execute`` listener.)"""
    wire = held(conn)
    if wire is not None:
        sync(conn, wire)


def finish(conn: Connection) -> bool:
    """Send the COMMIT of a transaction fleet began, with what ``send`` left pending,
    in one round trip. False: nothing is pending; the caller commits as usual (psycopg
    sends COMMIT if the transaction began, and nothing if no statement ran)."""
    wire = _WIRES.get(id(conn))
    if wire is None or wire.pipeline is None:
        return False
    sync(conn, wire, commit=True)
    return True


def send_all(
    conn: Connection, wire: _Wire, calls: Sequence[tuple[Any, Params]], hows: list[Any]
) -> list[Pending]:
    """Each statement (``hows``: the driver's compiled forms of ``calls``) into the
    wire's pipeline, opened (with the BEGIN, if it has not gone) if need be; they go
    out at the next ``sync``."""
    dbapi = wire.dbapi
    listening = conn._has_events or conn.engine._has_events
    sql, bound = "", None
    try:
        _open(wire)
        out = []
        for (_, params), how in zip(calls, hows, strict=True):
            sql, bound = how.sql, how.bind(params)
            cursor = dbapi.cursor()
            pending = Pending(conn, how, cursor)
            wire.pending.append(pending)
            out.append(pending)
            if listening:
                wire.driving = True
                try:
                    for fn in conn.dispatch.before_cursor_execute:
                        fn(conn, cursor, sql, bound, None, False)
                finally:
                    wire.driving = False
            cursor.execute(sql, bound)
        return out
    except Exception as exc:
        raise_wrapped(conn, exc, sql, bound)
        raise  # unreachable


def _open(wire: _Wire) -> None:
    """The wire's pipeline open, the transaction's BEGIN first in it if not yet sent."""
    if wire.pipeline is None:
        pipeline = wire.dbapi.pipeline()
        pipeline.__enter__()
        wire.pipeline = pipeline
    if wire.begin:
        wire.dbapi.execute(_BEGIN)
        wire.begin = False


def sync(conn: Connection, wire: _Wire, *, commit: bool = False) -> None:
    """Send what is queued (the BEGIN first if it has not gone; a COMMIT last if
    ``commit``) and read every result."""
    try:
        _open(wire)
        if commit:
            wire.dbapi.execute(_COMMIT)
        pipeline, wire.pipeline = wire.pipeline, None
        pipeline.__exit__(None, None, None)  # one Sync: every result comes back
    except Exception as exc:
        if wire.pipeline is not None:
            _close_quietly(wire)
        for p in wire.pending:
            p.cursor.close()
        wire.pending = []
        raise_wrapped(conn, exc, _COMMIT if commit else "(a pipeline's sync)", None)
    pending, wire.pending = wire.pending, []
    listening = conn._has_events or conn.engine._has_events
    for p in pending:
        if listening and p.how is not None:
            for fn in conn.dispatch.after_cursor_execute:
                fn(conn, p.cursor, p.how.sql, None, None, False)
        p._read()


def raise_wrapped(
    conn: Connection, exc: Exception, sql: str, params: Any, cursor: Any = None
) -> None:
    """Raise ``exc``: a driver error wrapped (and a lost connection invalidated) as
    SQLAlchemy does its own, anything else as it is."""
    if not isinstance(exc, conn.dialect.loaded_dbapi.Error):
        raise exc
    conn._handle_dbapi_exception(exc, sql, params, cursor, None)
