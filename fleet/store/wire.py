"""Statements sent together on Postgres, in libpq's pipeline mode, and the BEGIN and
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

The statements go out through psycopg's libpq connection itself (``pgconn``), not its
cursors: each is queued in libpq's output buffer as a prepared statement (prepared on
the connection the first time it is sent there, in the same pipeline), its values
as text, and ``sync`` writes the whole buffer at once and reads every result back, one
write and one wait for a round trip. psycopg's own pipeline writes and polls the socket
once per statement, so the server woke for each, and its per-statement machinery was a
fifth of a worker's CPU per step (bench/RESULTS.md, "Where a step's time goes"). Rows
are loaded by psycopg's own loaders, so they come back as its cursors return them; a
failed statement raises psycopg's error for it, wrapped as SQLAlchemy wraps its own.

Also the driver's result type, ``Rows``. The statements themselves are compiled and
bound by ``fleet/store/driver.py``, the only caller.
"""

from __future__ import annotations

import logging
from collections import namedtuple
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq
from psycopg.adapt import Transformer
from sqlalchemy.engine import Connection

from fleet.store import libpq

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


_BEGIN, _COMMIT = b"BEGIN", b"COMMIT"
_IDLE = pq.TransactionStatus.IDLE
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_FATAL_ERROR = pq.ExecStatus.FATAL_ERROR


class _Wire:
    """What fleet holds of one transaction's connection: the BEGIN still to be sent (if
    any), whether libpq's pipeline is open, and what is queued in it, in the order its
    results come back: a statement's ``Pending``, the name of a statement being
    prepared, or None (a BEGIN or COMMIT)."""

    __slots__ = ("begin", "dbapi", "open", "queued", "preparing", "driving", "broken")

    def __init__(self, dbapi: Any, begin: bytes | None = _BEGIN) -> None:
        self.dbapi = dbapi
        self.begin = begin
        self.open = False
        self.queued: list[Pending | bytes | None] = []
        self.preparing: set[bytes] = set()
        self.driving = False  # the driver is dispatching SQLAlchemy's listeners itself
        self.broken = False  # a round trip was cut short: what the server holds is unknown


_WIRES: dict[int, _Wire] = {}  # by id(conn), for the transactions fleet begins itself


def of(conn: Connection) -> _Wire | None:
    """The wire of ``conn``'s transaction, if fleet holds it."""
    return _WIRES.get(id(conn))


def held(conn: Connection) -> _Wire | None:
    """The wire of ``conn``'s transaction, if fleet holds it and something is to go out
    before the next statement (the BEGIN, or statements left pending)."""
    wire = _WIRES.get(id(conn))
    if wire is None or wire.driving or not (wire.begin or wire.open):
        return None
    return wire


def new_wire(dbapi: Any) -> _Wire:
    """A wire for one pipeline of statements outside a transaction fleet holds: if
    psycopg would begin a transaction before them, its BEGIN goes first."""
    begins = not dbapi.autocommit and dbapi.pgconn.transaction_status == _IDLE
    return _Wire(dbapi, dbapi._get_tx_start_command() if begins else None)


class Pending:
    """A statement sent and not yet read: ``rows()`` syncs its pipeline if need be."""

    __slots__ = ("conn", "how", "result")

    def __init__(self, conn: Connection, how: Compiled | None) -> None:
        self.conn, self.how = conn, how
        self.result: Rows | None = None

    def rows(self) -> Rows:
        if self.result is None:
            wire = _WIRES.get(id(self.conn))
            if wire is not None and wire.open:
                sync(self.conn, wire)
        if self.result is None:  # its pipeline failed before it ran (sync raised)
            raise LookupError("the statement did not run: its pipeline failed")
        return self.result


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
        idle = dbapi.pgconn.transaction_status == _IDLE
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
        if wire.open:
            _close_quietly(wire)
        if not wire.broken and wire.dbapi.pgconn.transaction_status == _IDLE:
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
    if not hasattr(dbapi, "pgconn"):
        return False
    if not _PIPELINES:
        from psycopg import capabilities

        _PIPELINES.append(capabilities.has_pipeline())
    return _PIPELINES[0]


def abandon(conn: Connection) -> None:
    """The transaction failed: end any open pipeline (what is queued in it is sent and
    its results read), ignoring what it raises, so the rollback can be sent."""
    wire = _WIRES.get(id(conn))
    if wire is not None and wire.open:
        _close_quietly(wire)


def _close_quietly(wire: _Wire) -> None:
    try:
        if not wire.broken:
            _trip(wire)
    except Exception as exc:  # noqa: BLE001 - the caller rolls back or gives it up
        log.debug("pipeline closed with an error: %s", exc)


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
    if wire is None or not wire.open:
        return False
    sync(conn, wire, commit=True)
    return True


def send_all(
    conn: Connection, wire: _Wire, calls: Sequence[tuple[Any, Params]], hows: list[Any]
) -> list[Pending]:
    """Each statement (``hows``: the driver's compiled forms of ``calls``) queued in the
    wire's pipeline, opened (with the BEGIN, if it has not gone) if need be, each
    prepared first on this connection if it has not been; they go out at the next
    ``sync``."""
    pgconn = wire.dbapi.pgconn
    prepared = _prepared(wire.dbapi)
    listening = conn._has_events or conn.engine._has_events
    sql, bound = "", None
    try:
        _open(wire)
        out = []
        for (_, params), how in zip(calls, hows, strict=True):
            sql, bound = how.sql, how.bind(params)
            native = how.native
            if listening:
                wire.driving = True
                try:
                    for fn in conn.dispatch.before_cursor_execute:
                        fn(conn, None, sql, bound, None, False)
                finally:
                    wire.driving = False
            values = [libpq.text_value(bound[name]) for name in native.names]
            if native.name not in prepared and native.name not in wire.preparing:
                pgconn.send_prepare(native.name, native.sql, param_types=native.types)
                wire.preparing.add(native.name)
                wire.queued.append(native.name)
            pgconn.send_query_prepared(native.name, values)
            pending = Pending(conn, how)
            wire.queued.append(pending)
            out.append(pending)
        return out
    except Exception as exc:
        if wire.open and _WIRES.get(id(conn)) is not wire:
            _close_quietly(wire)  # no ``abandon`` will see this one: the pipeline ends here
        raise_wrapped(conn, exc, sql, bound)
        raise  # unreachable


def prepares_alone(dbapi: Any, _record: Any = None) -> None:
    """A new connection prepares only fleet's statements: psycopg, which prepares a
    statement it has seen five times, deallocates every prepared statement of the
    session (DEALLOCATE ALL) at a rollback after it has prepared one of its own, and
    would take fleet's with them. The driver's statements (all of a step's) are
    prepared by fleet; the rest (SQLAlchemy's: the console's reads, the sweeper's
    scans) are planned as they run. (A ``connect`` listener on Postgres engines.)"""
    if pipelines(dbapi):
        dbapi.prepare_threshold = None
        dbapi._fleet_prepared = set()


def _prepared(dbapi: Any) -> set[bytes]:
    """The names of the statements fleet prepared on this connection (its session's)."""
    try:
        names: set[bytes] = dbapi._fleet_prepared
    except AttributeError:  # a connection fleet's engine did not open
        names = dbapi._fleet_prepared = set()
    return names


def _open(wire: _Wire) -> None:
    """The wire's pipeline open, the transaction's BEGIN first in it if not yet sent."""
    pgconn = wire.dbapi.pgconn
    if not wire.open:
        pgconn.enter_pipeline_mode()
        wire.open = True
    if wire.begin:
        pgconn.send_query_params(wire.begin, None)
        wire.queued.append(None)
        wire.begin = None


def sync(conn: Connection, wire: _Wire, *, commit: bool = False) -> None:
    """Send what is queued (the BEGIN first if it has not gone; a COMMIT last if
    ``commit``) in one write, and read every result; the first error among them is
    raised (wrapped), after every result is read."""
    what = "COMMIT" if commit else "(a pipeline's sync)"  # as an error names it
    try:
        _open(wire)
        if commit:
            wire.dbapi.pgconn.send_query_params(_COMMIT, None)
            wire.queued.append(None)
        queued, results = _trip(wire)
    except Exception as exc:
        raise_wrapped(conn, exc, what, None)
        raise  # unreachable
    listening = conn._has_events or conn.engine._has_events
    loader = Transformer(wire.dbapi)
    failed = None
    for entry, result in zip(queued, results, strict=False):
        status = result.status
        if status == _FATAL_ERROR and failed is None:
            failed = psycopg.errors.error_from_result(result, encoding=wire.dbapi.pgconn._encoding)
        if not isinstance(entry, Pending) or entry.how is None:
            continue
        if listening:
            for fn in conn.dispatch.after_cursor_execute:
                fn(conn, None, entry.how.sql, None, None, False)
        if status == _TUPLES_OK or status == pq.ExecStatus.COMMAND_OK:
            entry.result = _rows(loader, result, entry.how.columns)
    if failed is not None:
        raise_wrapped(conn, failed, what, None)


def _trip(wire: _Wire) -> tuple[list[Pending | bytes | None], list[Any]]:
    """One round trip: the Sync queued after what is queued, libpq's buffer written,
    each queued entry's last result read (then the Sync's), the pipeline closed and the
    statements that were prepared in it noted. What was queued and, by entry, its
    result. Cut short (the connection lost, the caller interrupted), the wire is broken
    and ``release`` gives its connection up."""
    dbapi = wire.dbapi
    pgconn = dbapi.pgconn
    queued, wire.queued = wire.queued, []
    wire.broken = True
    pgconn.pipeline_sync()
    with dbapi.lock:
        results = dbapi.wait(libpq.round_trip(pgconn, len(queued)))
    pgconn.exit_pipeline_mode()
    wire.open, wire.broken = False, False
    prepared = _prepared(dbapi)
    for entry, result in zip(queued, results, strict=False):
        if isinstance(entry, bytes) and result.status == pq.ExecStatus.COMMAND_OK:
            prepared.add(entry)
    wire.preparing.clear()
    return queued, results


def _rows(loader: Any, result: Any, columns: tuple[str, ...]) -> Rows:
    """What one statement returned: its rows as named tuples of ``columns`` (none read
    if it names none), loaded as psycopg's cursors load them, and the rows it touched."""
    touched = result.command_tuples
    count = -1 if touched is None else touched
    if not columns or result.status != _TUPLES_OK or not result.ntuples:
        return Rows([], count)
    loader.set_pgresult(result)
    return Rows(loader.load_rows(0, result.ntuples, _row_type(columns)._make), count)


def raise_wrapped(
    conn: Connection, exc: Exception, sql: str, params: Any, cursor: Any = None
) -> None:
    """Raise ``exc``: a driver error wrapped (and a lost connection invalidated) as
    SQLAlchemy does its own, anything else as it is."""
    if not isinstance(exc, conn.dialect.loaded_dbapi.Error):
        raise exc
    conn._handle_dbapi_exception(exc, sql, params, cursor, None)
