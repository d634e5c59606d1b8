"""The statements a step runs on every attempt, executed below SQLAlchemy; on Postgres,
sent together in libpq's pipeline with their transaction's BEGIN and COMMIT.

SQLAlchemy compiles each statement once per dialect (``compiled``); a call binds its
values and runs the SQL in the caller's transaction, skipping SQLAlchemy's
per-execution machinery (its compiled-cache lookup, parameter construction and result
set-up), which cost more of a step than its round trips (bench/RESULTS.md, "Where a
step's time goes"). The rest is SQLAlchemy's: the transaction is the caller's, a
driver error is wrapped as SQLAlchemy wraps its own (a lost connection invalidated),
and ``before_cursor_execute``/``after_cursor_execute`` listeners see each statement. A
statement whose values or result columns need processing beyond a bind processor, or
that binds a list, runs through ``Connection.execute`` (``compiled`` decides, once).

On Postgres a ``Database.transaction`` holds a ``Line``: its BEGIN, sent by fleet with
the first statements (the connection is in psycopg's autocommit meanwhile: psycopg
would send a BEGIN of its own and wait for it), statements ``send`` leaves pending until
the next sync, and its COMMIT, sent with the last of them (``finish``): a transaction
of a few writes is one round trip. The statements go out through psycopg's public libpq
wrapper (``Connection.pgconn``, ``psycopg.pq``), each queued in libpq's output buffer
as a statement prepared on that connection (in the same pipeline, the first time it
goes out there), so a round trip is one write and one wait. psycopg's own pipeline
(``Connection.pipeline()``) writes and polls the socket once per statement: measured,
it cost a step two thirds more of a worker's CPU (bench/RESULTS.md, §13). Rows are
loaded by psycopg's own loaders. A statement that is not the driver's (anything run
through SQLAlchemy) first syncs what is pending (``settle``, a listener on Postgres
engines), so statements run in the order they were given. ``release`` hands the
connection back to psycopg's own transactions.

fleet prepares its statements unless the connection says it prepares none (psycopg's
``prepare_threshold=None``, as behind PgBouncer in transaction mode); psycopg itself
then prepares none of SQLAlchemy's (``prepares_alone``): at a rollback it deallocates
every statement of the session, fleet's too.
"""

from __future__ import annotations

import enum
import re
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, NoReturn

import psycopg
from psycopg import capabilities, generators, pq
from psycopg.adapt import PyFormat, Transformer
from sqlalchemy import Boolean, Float, Integer
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

# Where ``Database.transaction`` puts its ``Transaction`` in the connection's ``info``
# while it is open (its ``line`` and ``committed`` are found there), and where the
# names of the statements fleet prepared on that session are kept (SQLAlchemy clears a
# connection's ``info`` when it opens a new session in its place).
OPEN = "fleet.transaction"
PREPARED = "fleet.prepared"
_IDLE = pq.TransactionStatus.IDLE
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_FATAL_ERROR = pq.ExecStatus.FATAL_ERROR

Params = Mapping[str, Any]


class Rows:
    """What a statement returned: its rows (named tuples: by position or by column
    name) and the count of rows a write touched."""

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
        made = _ROW_TYPES[columns] = namedtuple("Row", columns, rename=True)
    return made


class Native:
    """A statement as libpq takes it: the name it is prepared under on a connection,
    its SQL with positional parameters, the bound values' names in that order, and the
    type of each parameter (0: the server infers it from the statement)."""

    __slots__ = ("name", "sql", "names", "types")

    def __init__(self, serial: int, sql: str, types: dict[str, int]) -> None:
        names: list[str] = []

        def positional(match: re.Match[str]) -> str:
            if match.group(1) is None:
                return "%"  # a literal %, escaped as %% in the driver's paramstyle
            if match.group(1) not in names:
                names.append(match.group(1))
            return f"${names.index(match.group(1)) + 1}"

        self.name = f"fleet_{serial}".encode()
        self.sql = _PLACEHOLDER.sub(positional, sql).encode()
        self.names = tuple(names)
        self.types = tuple(types.get(name, 0) for name in names)


_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")
_ANY = Transformer()  # psycopg's dumpers, for a value of a type ``text_value`` does not know


def text_value(value: Any) -> bytes | None:
    """``value`` as a parameter in text format, as psycopg would send it."""
    kind = type(value)
    if kind is str:
        if "\x00" in value:
            raise psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
        return value.encode()
    if value is None:
        return None
    if kind is int:
        return b"%d" % value
    if kind is float:
        return repr(value).encode()
    if kind is bool:
        return b"t" if value else b"f"
    dumped = _ANY.get_dumper(value, PyFormat.TEXT).dump(value)
    return None if dumped is None else bytes(dumped)


class Line:
    """One Postgres transaction's pipeline: its BEGIN still to be sent (if any), whether
    libpq's pipeline is open, and what is queued in it, in the order its results come
    back: a statement's ``Pending``, the name of a statement being prepared, or None (a
    BEGIN or a COMMIT)."""

    __slots__ = ("dbapi", "prepared", "begin", "open", "queued", "preparing", "broken")

    def __init__(self, dbapi: Any, prepared: set[bytes] | None, begin: bool = True) -> None:
        self.dbapi = dbapi
        self.prepared = prepared  # None: the connection prepares nothing
        self.begin = begin
        self.open = False
        self.queued: list[Pending | bytes | None] = []
        self.preparing: set[bytes] = set()
        self.broken = False  # a round trip was cut short: what the server holds is unknown

    def start(self) -> None:
        """The pipeline open, the transaction's BEGIN first in it if not yet sent."""
        pgconn = self.dbapi.pgconn
        if not self.open:
            pgconn.enter_pipeline_mode()
            self.open = True
        if self.begin:
            pgconn.send_query_params(b"BEGIN", None)
            self.queued.append(None)
            self.begin = False

    def queue(self, pending: Pending, native: Native, values: list[bytes | None]) -> None:
        pgconn = self.dbapi.pgconn
        if self.prepared is None:
            pgconn.send_query_params(native.sql, values, param_types=native.types)
        else:
            if native.name not in self.prepared and native.name not in self.preparing:
                pgconn.send_prepare(native.name, native.sql, param_types=native.types)
                self.preparing.add(native.name)
                self.queued.append(native.name)
            pgconn.send_query_prepared(native.name, values)
        self.queued.append(pending)

    def trip(self) -> list[tuple[Pending | bytes | None, Any]]:
        """One round trip: a Sync after what is queued, libpq's buffer written, each
        entry's last result read (then the Sync's), the pipeline closed and the
        statements prepared in it noted. Cut short (the connection lost, the caller
        interrupted), the line is broken and ``release`` gives its connection up."""
        dbapi = self.dbapi
        pgconn = dbapi.pgconn
        queued, self.queued = self.queued, []
        self.broken = True
        pgconn.pipeline_sync()
        with dbapi.lock:
            results = dbapi.wait(_round_trip(pgconn, len(queued)))
        pgconn.exit_pipeline_mode()
        self.open, self.broken = False, False
        for entry, result in zip(queued, results, strict=False):
            if isinstance(entry, bytes) and result.status == _COMMAND_OK:
                assert self.prepared is not None
                self.prepared.add(entry)
        self.preparing.clear()
        return list(zip(queued, results, strict=False))

    def sync(self, conn: Connection, *, commit: bool = False) -> None:
        """Send what is queued (the BEGIN first if it has not gone; a COMMIT last if
        ``commit``) in one write, and read every result; the first error among them is
        raised (wrapped), after every result is read."""
        what = "COMMIT" if commit else "(a pipeline's sync)"  # as an error names it
        try:
            self.start()
            if commit:
                self.dbapi.pgconn.send_query_params(b"COMMIT", None)
                self.queued.append(None)
            done = self.trip()
        except Exception as exc:
            raise_wrapped(conn, exc, what, None)
        listeners = conn.dispatch.after_cursor_execute
        loader = Transformer(self.dbapi)
        failed = None
        for entry, result in done:
            status = result.status
            if status == _FATAL_ERROR and failed is None:
                encoding = self.dbapi.info.encoding
                failed = psycopg.errors.error_from_result(result, encoding=encoding)
            if not isinstance(entry, Pending):
                continue
            _notify(conn, listeners, entry.sql, None)
            if status in (_TUPLES_OK, _COMMAND_OK):
                entry.result = _loaded(loader, result)
        if failed is not None:
            raise_wrapped(conn, failed, what, None)

    def close_quietly(self) -> None:
        with suppress(Exception):  # the caller rolls back or gives the connection up
            if self.open and not self.broken:
                self.trip()


def _round_trip(pgconn: Any, expected: int) -> Any:
    """psycopg's generator protocol (run by the connection's ``wait``): libpq's buffer
    written, then ``expected`` statements' results read and the Sync's; each
    statement's last result, in order."""
    yield from generators.send(pgconn)
    out = []
    for _ in range(expected + 1):
        results = yield from generators.fetch_many(pgconn)
        if not results:  # libpq has nothing more to give: the session is gone
            raise psycopg.OperationalError("the server sent fewer results than statements")
        out.append(results[-1])
    return out


def _loaded(loader: Any, result: Any) -> Rows:
    """What one statement returned: its rows as named tuples of its columns, loaded as
    psycopg's cursors load them, and the rows it touched."""
    touched = result.command_tuples
    count = -1 if touched is None else touched
    if result.status != _TUPLES_OK or not result.ntuples:
        return Rows([], count)
    columns = tuple(result.fname(i).decode() for i in range(result.nfields))
    loader.set_pgresult(result)
    return Rows(loader.load_rows(0, result.ntuples, _row_type(columns)._make), count)


class Pending:
    """A statement sent and perhaps not yet read: ``rows()`` syncs its pipeline if need
    be. ``result`` is None until it has been read."""

    __slots__ = ("conn", "line", "sql", "result")

    def __init__(self, conn: Connection, line: Line | None, sql: str) -> None:
        self.conn, self.line, self.sql = conn, line, sql
        self.result: Rows | None = None

    def rows(self) -> Rows:
        if self.result is None and self.line is not None and self.line.open:
            self.line.sync(self.conn)
        if self.result is None:  # its pipeline failed before it ran (the sync raised)
            raise LookupError("the statement did not run: its pipeline failed")
        return self.result


@dataclass(frozen=True, slots=True)
class Compiled:
    """One statement for one dialect: its SQL, the values it carries itself, and how a
    call's values are bound (by name, or in ``order`` for a positional driver)."""

    sql: str
    constants: dict[str, Any]
    order: tuple[str, ...] | None
    processors: dict[str, Callable[[Any], Any]]
    native: Native | None  # as libpq takes it: psycopg's dialect only

    def bind(self, params: Params) -> Any:
        values = {**self.constants, **params}
        for name, process in self.processors.items():
            if name in params:
                values[name] = process(values[name])
        if self.order is None:
            return values
        return tuple(values[name] for name in self.order)


# (id of the statement, dialect, driver) → how to run it. Only module constants built
# at import are run here, so their ids are stable for the process's life and this
# holds one entry per statement and driver.
_COMPILED: dict[tuple[int, str, str], Compiled | None] = {}
_KEEP: list[Any] = []  # the statements keyed above, kept alive so their ids stay theirs
_SERIALS = iter(range(1 << 62))  # each statement's prepared name, unique in the process


def compiled(stmt: Any, conn: Connection) -> Compiled | None:
    """``stmt`` compiled for ``conn``'s dialect, once; None: run it through SQLAlchemy."""
    dialect = conn.dialect
    key = (id(stmt), dialect.name, dialect.driver)
    try:
        return _COMPILED[key]
    except KeyError:
        pass
    made = _compile(stmt, dialect)
    _KEEP.append(stmt)
    _COMPILED[key] = made
    return made


def _compile(stmt: Any, dialect: Any) -> Compiled | None:
    comp = stmt.compile(dialect=dialect)
    columns = getattr(stmt, "exported_columns", ())
    if not all(_as_given(column.type, dialect) for column in columns):
        return None  # a result column must come back as the driver gives it
    binds = {comp.bind_names[bind]: bind for bind in comp.binds.values()}
    if any(bind.expanding for bind in binds.values()):
        return None
    processors = {}
    for name, bind in binds.items():
        process = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if process is not None:
            processors[name] = process
    constants = {}
    for name, value in comp.params.items():
        if binds[name].required:
            continue
        if isinstance(value, enum.Enum):
            value = value.value
        process = processors.pop(name, None)
        constants[name] = value if process is None else process(value)
    order = tuple(comp.positiontup) if comp.positional else None
    native = None
    if dialect.driver == "psycopg" and not comp.positional:
        types = {name: _oid(bind.type) for name, bind in binds.items()}
        native = Native(next(_SERIALS), comp.string, types)
    return Compiled(comp.string, constants, order, processors, native)


def _oid(type_: Any) -> int:
    """The Postgres type a parameter of ``type_`` is declared as when its statement is
    prepared: numbers and booleans by their own (a bare one, as in ``SELECT $1 AS
    cost``, is otherwise text); everything else left to the server to infer from the
    statement (its casts and columns), as for psycopg's strings."""
    if isinstance(type_, Boolean):
        return 16  # bool
    if isinstance(type_, Float):
        return 701  # float8
    if isinstance(type_, Integer):
        return 20  # int8
    return 0


def _as_given(type_: Any, dialect: Any) -> bool:
    """A column of ``type_`` needs no processing of what the driver returns: a float
    column (double precision, returned as a float) or one with no result processor."""
    if isinstance(type_, Float) and not type_.asdecimal:
        return True
    return type_.dialect_impl(dialect).result_processor(dialect, None) is None


def line_of(conn: Connection) -> Line | None:
    """The pipeline of the ``Database.transaction`` ``conn`` is in, if it has one."""
    try:
        tx = conn.info.get(OPEN)
    except Exception:  # noqa: BLE001 - a connection the store dropped has no info
        return None
    return None if tx is None or tx.conn is not conn else tx.line


def _pipelines(dbapi: Any) -> bool:
    """Whether statements can be sent together on this DBAPI connection: psycopg's,
    with a libpq that has pipeline mode (14 or later)."""
    return hasattr(dbapi, "pgconn") and capabilities.has_pipeline()


def own(conn: Connection) -> Line | None:
    """A line for ``conn``'s transaction, just begun and nothing run in it yet, whose
    BEGIN and COMMIT fleet sends itself (the module docstring); None where it cannot
    (no pipeline mode, or a transaction that needs more than a plain BEGIN).
    ``release`` ends it."""
    dbapi: Any = conn.connection.driver_connection
    if not _pipelines(dbapi):
        return None
    plain = (dbapi.isolation_level, dbapi.read_only, dbapi.deferrable) == (None,) * 3
    if not plain or dbapi.autocommit or dbapi.pgconn.transaction_status != _IDLE:
        return None
    dbapi.autocommit = True  # psycopg sends no BEGIN of its own
    return Line(dbapi, conn.info.get(PREPARED))


def _passing(conn: Connection, dbapi: Any) -> Line:
    """A line for statements sent together outside a transaction fleet holds: if
    psycopg would begin a transaction before them, a BEGIN goes first."""
    begins = not dbapi.autocommit and dbapi.pgconn.transaction_status == _IDLE
    return Line(dbapi, conn.info.get(PREPARED), begin=begins)


def prepares_alone(dbapi: Any, record: Any) -> None:
    """A new connection: fleet prepares its own statements on it unless it prepares
    none (``prepare_threshold=None``), and psycopg prepares none of SQLAlchemy's (it
    deallocates every statement of the session at a rollback after preparing one of
    its own). (A ``connect`` listener on Postgres engines.)"""
    if _pipelines(dbapi) and dbapi.prepare_threshold is not None:
        dbapi.prepare_threshold = None
        record.info[PREPARED] = set()


def finish(conn: Connection, line: Line | None) -> None:
    """Send the COMMIT of a transaction fleet began with what ``send`` left pending, in
    one round trip. Nothing if nothing is pending: the caller's commit then sends it
    (psycopg sends COMMIT if the transaction began, nothing if no statement ran)."""
    if line is not None and line.open:
        line.sync(conn, commit=True)


def abandon(line: Line | None) -> None:
    """The transaction failed: end any open pipeline (what is queued in it is sent and
    its results read), ignoring what it raises, so the rollback can be sent."""
    if line is not None:
        line.close_quietly()


def release(conn: Connection, line: Line | None) -> None:
    """The transaction has ended: its connection goes back to psycopg's own
    transactions, or is invalidated if it cannot."""
    if line is None:
        return
    line.close_quietly()
    with suppress(Exception):  # a connection that cannot say so is not fit for the pool
        if not line.broken and line.dbapi.pgconn.transaction_status == _IDLE:
            line.dbapi.autocommit = False
            return
    with suppress(Exception):  # never hide the transaction's own error
        conn.invalidate()


def settle(conn: Connection, _cursor: Any, _sql: Any, _params: Any, context: Any, *_: Any) -> None:
    """Before a statement that is not the driver's (SQLAlchemy runs it, with an
    execution context): the BEGIN sent if it has not gone, and what ``send`` left
    pending synced. (A ``before_cursor_execute`` listener.)"""
    if context is None:
        return
    line = line_of(conn)
    if line is not None and (line.open or line.begin):
        line.sync(conn)


def send(conn: Connection, stmt: Any, params: Params) -> Pending:
    """Execute ``stmt`` as ``run`` does, but in a transaction fleet began on Postgres,
    leave it in the open pipeline: it goes out with the next sync (its ``rows()``, a
    statement that is not the driver's, or the COMMIT). Elsewhere it runs now."""
    line = line_of(conn)
    how = compiled(stmt, conn)
    if line is None or how is None or how.native is None:
        done = Pending(conn, None, "")
        done.result = _as_rows(run(conn, stmt, params))
        return done
    (pending,) = _send_all(conn, line, [how], [params])
    return pending


def _send_all(
    conn: Connection, line: Line, hows: Sequence[Compiled], params: Sequence[Params]
) -> list[Pending]:
    """Each statement queued in the line's pipeline (opened, with the BEGIN, if need
    be); they go out at the next sync."""
    listeners = conn.dispatch.before_cursor_execute
    sql, bound = "", None
    try:
        line.start()
        out = []
        for how, one in zip(hows, params, strict=True):
            native = how.native
            assert native is not None
            sql, bound = how.sql, how.bind(one)
            _notify(conn, listeners, sql, bound)
            pending = Pending(conn, line, sql)
            line.queue(pending, native, [text_value(bound[name]) for name in native.names])
            out.append(pending)
        return out
    except Exception as exc:
        if line_of(conn) is not line:
            line.close_quietly()  # no ``abandon`` will see this one: it ends here
        raise_wrapped(conn, exc, sql, bound)


def pipelined(conn: Connection, calls: Sequence[tuple[Any, Params]]) -> list[Rows]:
    """Execute each ``(stmt, params)`` in order, in ``conn``'s transaction, in one round
    trip where the driver can (the statements go out together, with the transaction's
    BEGIN if fleet began it, and come back at one sync); elsewhere one ``run`` after
    another. Each statement sees the writes of those before it. An error is raised at
    the sync, wrapped as ``run`` wraps it, and leaves the transaction failed."""
    hows = [compiled(stmt, conn) for stmt, _ in calls]
    dbapi: Any = conn.connection.driver_connection
    if not _pipelines(dbapi) or any(how is None or how.native is None for how in hows):
        return [_as_rows(run(conn, stmt, params)) for stmt, params in calls]
    held = line_of(conn)
    line = held if held is not None else _passing(conn, dbapi)
    ready = [how for how in hows if how is not None]
    sent = _send_all(conn, line, ready, [params for _, params in calls])
    line.sync(conn)
    return [pending.rows() for pending in sent]


def commit_sent(conn: Connection) -> None:
    """In a transaction fleet began (Postgres), send its COMMIT now, with what ``send``
    left pending, in one round trip; its own end then sends nothing more. Only for a
    transaction that runs nothing after this. Elsewhere nothing: it commits at its end."""
    finish(conn, line_of(conn))


def run(conn: Connection, stmt: Any, params: Params | Sequence[Params]) -> Any:
    """Execute ``stmt`` with ``params`` (one set, or a list for executemany) in
    ``conn``'s transaction; returns ``Rows`` (or SQLAlchemy's result, for a statement
    it must run itself)."""
    how = compiled(stmt, conn)
    if how is None:
        return conn.execute(stmt, params)
    batch = [params] if isinstance(params, Mapping) else list(params)
    if how.native is not None and _pipelines(conn.connection.driver_connection):
        if not batch:
            return Rows([], 0)
        done = pipelined(conn, [(stmt, one) for one in batch])
        return done[0] if len(done) == 1 else Rows([], sum(max(r.rowcount, 0) for r in done))
    line = line_of(conn)
    if line is not None and (line.open or line.begin):
        line.sync(conn)  # the BEGIN and what is pending go first
    many = len(batch) != 1
    bound = [how.bind(p) for p in batch] if many else how.bind(batch[0])
    dbapi: Any = conn.connection.driver_connection
    cursor = dbapi.cursor()
    try:
        _notify(conn, conn.dispatch.before_cursor_execute, how.sql, bound, many)
        if many:
            cursor.executemany(how.sql, bound)
        else:
            cursor.execute(how.sql, bound)
        _notify(conn, conn.dispatch.after_cursor_execute, how.sql, bound, many)
        if many or cursor.description is None:
            return Rows([], cursor.rowcount)
        columns = tuple(column[0] for column in cursor.description)
        return Rows([_row_type(columns)(*row) for row in cursor.fetchall()], cursor.rowcount)
    except Exception as exc:
        raise_wrapped(conn, exc, how.sql, bound)
    finally:
        cursor.close()


def _notify(conn: Connection, listeners: Any, sql: str, bound: Any, many: bool = False) -> None:
    for fn in listeners:
        fn(conn, None, sql, bound, None, many)


def _as_rows(result: Any) -> Rows:
    if isinstance(result, Rows):
        return result
    rows = list(result) if result.returns_rows else []
    return Rows(rows, result.rowcount)


def raise_wrapped(conn: Connection, exc: Exception, sql: str, params: Any) -> NoReturn:
    """Raise ``exc``: a driver error wrapped (and its connection invalidated, if it was
    lost) as SQLAlchemy does its own; anything else as it is."""
    dbapi_error = conn.dialect.loaded_dbapi.Error
    if not isinstance(exc, dbapi_error):
        raise exc
    try:
        dbapi = conn.connection.dbapi_connection
        lost = conn.dialect.is_disconnect(exc, dbapi, None)
    except Exception:  # noqa: BLE001 - a connection already invalidated
        lost = True
    if lost and not conn.invalidated:
        conn.invalidate(exc)
    raise DBAPIError.instance(
        sql, params, exc, dbapi_error, connection_invalidated=lost, dialect=conn.dialect
    ) from exc
