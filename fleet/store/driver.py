"""The statements a step runs on every attempt, executed below SQLAlchemy.

SQLAlchemy compiles each of them once per dialect (``compiled``); a call then binds
its values and hands the SQL to the connection the caller's transaction holds (on
Postgres to ``wire.py``, which sends it through libpq as a statement fleet prepared
on that connection; elsewhere to the DBAPI cursor), skipping SQLAlchemy's
per-execution machinery (its compiled-cache lookup, parameter construction and
expansion, and result set-up), which cost more of a step than the statements' round
trips did (bench/RESULTS.md, "Where a step's time goes"). Everything else about the
execution is SQLAlchemy's: the transaction is the caller's, a driver error is wrapped
as SQLAlchemy wraps it (a dropped connection is invalidated), and
``before_cursor_execute``/``after_cursor_execute`` listeners see each statement.

Only statements whose values need no per-execution processing beyond a bind
processor, and whose result columns need none, are run so; ``run`` falls back to
``Connection.execute`` for any other (``compiled`` decides, once).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Boolean, Float, Integer
from sqlalchemy.engine import Connection

from fleet.store import libpq, wire
from fleet.store.wire import Rows

# (id of the statement, dialect, driver) → how to run it. Only module constants built
# at import are run here, so their ids are stable for the process's life and this
# holds one entry per statement and driver.
_COMPILED: dict[tuple[int, str, str], Compiled | None] = {}
_SERIALS = itertools.count()  # each statement's prepared name on Postgres, unique in the process
_KEEP: list[Any] = []  # the statements keyed above, kept alive so their ids stay theirs

Params = Mapping[str, Any]


@dataclass(frozen=True)
class Compiled:
    """One statement for one dialect: its SQL, the values it carries itself, and how a
    call's values are bound (by name, or in ``order`` for a positional driver)."""

    sql: str
    constants: dict[str, Any]
    order: tuple[str, ...] | None
    processors: dict[str, Callable[[Any], Any]]
    columns: tuple[str, ...]
    # As libpq takes it, where statements go out through psycopg's libpq connection
    # (fleet/store/wire.py): psycopg's dialect only.
    native: libpq.Native | None

    def bind(self, params: Params) -> Any:
        values = {**self.constants, **params}
        for name, process in self.processors.items():
            if name in params:
                values[name] = process(values[name])
        if self.order is None:
            return values
        return tuple(values[name] for name in self.order)


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
    # Each result column must come back as the driver gives it.
    result_columns = comp._result_columns
    if not all(_as_given(entry.type, dialect) for entry in result_columns):
        return None
    required = {name for name, bind in comp.binds.items() if bind.required}
    # Expanded once: the only expanding binds are the statement's own constant lists
    # (``status IN (…)``), whose length never changes.
    expanded = comp._process_parameters_for_postcompile(comp.construct_params(_check=False))
    processors = dict(comp._bind_processors)
    processors.update(expanded.processors)
    constants = {}
    for name, value in expanded.parameters.items():
        if name in required:
            continue
        if isinstance(value, enum.Enum):
            value = value.value
        process = processors.pop(name, None)
        constants[name] = value if process is None else process(value)
    order = tuple(expanded.positiontup) if comp.positional else None
    columns = tuple(entry.keyname for entry in result_columns)
    native = None
    if dialect.driver == "psycopg" and not comp.positional:
        types = {name: _oid(bind.type) for name, bind in comp.binds.items()}
        native = libpq.Native(next(_SERIALS), expanded.statement, types)
    return Compiled(expanded.statement, constants, order, processors, columns, native)


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
    return type_._cached_result_processor(dialect, None) is None


def pipelined(conn: Connection, calls: Sequence[tuple[Any, Params]]) -> list[Rows]:
    """Execute each ``(stmt, params)`` in order, in ``conn``'s transaction, in one round
    trip where the driver can (psycopg's pipeline mode: the statements go out together,
    with the transaction's BEGIN if fleet began it, and come back at one sync);
    elsewhere one ``run`` after another. Each statement sees the writes of those before
    it, as when they run one by one. An error is raised at the sync, wrapped as ``run``
    wraps it, and leaves the transaction failed."""
    hows = [compiled(stmt, conn) for stmt, _ in calls]
    dbapi: Any = conn.connection.dbapi_connection
    if not wire.pipelines(dbapi) or any(how is None or how.native is None for how in hows):
        return [_as_rows(run(conn, stmt, params)) for stmt, params in calls]
    held = wire.of(conn)
    line = held if held is not None else wire.new_wire(dbapi)
    mine = wire.send_all(conn, line, calls, hows)
    wire.sync(conn, line)
    return [p.rows() for p in mine]


def send(conn: Connection, stmt: Any, params: Params) -> wire.Pending:
    """Execute ``stmt`` as ``run`` does, but in a transaction fleet began, leave it in
    an open pipeline: it goes out with the next sync (the next statement read, one
    that is not the driver's, or the COMMIT). Elsewhere it runs now."""
    line = wire.of(conn)
    how = compiled(stmt, conn)
    if line is None or how is None or how.native is None:
        done = wire.Pending(conn, how)
        done.result = _as_rows(run(conn, stmt, params))
        return done
    (pending,) = wire.send_all(conn, line, [(stmt, params)], [how])
    return pending


def commit_sent(conn: Connection) -> None:
    """In a transaction fleet began (Postgres), send its COMMIT now, with what ``send``
    left pending, in one round trip; its own end then sends nothing more. Only for a
    transaction that runs nothing after this. Elsewhere nothing: it commits at its end."""
    wire.finish(conn)


def _as_rows(result: Any) -> Rows:
    if isinstance(result, Rows):
        return result
    rows = list(result) if result.returns_rows else []
    return Rows(rows, result.rowcount)


def run(conn: Connection, stmt: Any, params: Params | Sequence[Params]) -> Any:
    """Execute ``stmt`` with ``params`` (one set, or a list for executemany) in
    ``conn``'s transaction; returns ``Rows`` (or SQLAlchemy's result, for a statement
    it must run itself)."""
    how = compiled(stmt, conn)
    native = how is not None and how.native is not None
    if native and wire.pipelines(conn.connection.dbapi_connection):  # prepared, on the wire
        batch = [params] if isinstance(params, Mapping) else list(params)
        if not batch:
            return Rows([], 0)
        done = pipelined(conn, [(stmt, one) for one in batch])
        return done[0] if len(done) == 1 else Rows([], sum(max(r.rowcount, 0) for r in done))
    line = wire.held(conn)
    if line is not None:  # SQLAlchemy runs this one: the BEGIN and what is pending go first
        wire.sync(conn, line)
    if how is None:
        return conn.execute(stmt, params)
    if isinstance(params, Mapping) or len(params) == 1:
        one = params if isinstance(params, Mapping) else params[0]
        many, bound = False, how.bind(one)
    else:
        many, bound = True, [how.bind(p) for p in params]
    dbapi = conn.connection.dbapi_connection
    assert dbapi is not None
    cursor = dbapi.cursor()
    sql = how.sql
    try:
        listening = conn._has_events or conn.engine._has_events
        if listening:
            for fn in conn.dispatch.before_cursor_execute:
                fn(conn, cursor, sql, bound, None, many)
        if many:
            cursor.executemany(sql, bound)
        else:
            cursor.execute(sql, bound)
        if listening:
            for fn in conn.dispatch.after_cursor_execute:
                fn(conn, cursor, sql, bound, None, many)
        return wire.rows_of(cursor, () if many else how.columns)
    except Exception as exc:
        wire.raise_wrapped(conn, exc, sql, bound, cursor)
        raise  # unreachable: it raises
    finally:
        cursor.close()
