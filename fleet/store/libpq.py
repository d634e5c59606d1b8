"""What fleet's driver speaks to libpq directly (``fleet/store/wire.py``): a statement
as libpq takes it (its prepared name, positional SQL and parameter types), a value as
a text parameter, and one round trip of a pipeline driven as psycopg drives its own
(a generator of what to wait for, run by the connection's ``wait``)."""

from __future__ import annotations

import re
from typing import Any

import psycopg
from psycopg import generators
from psycopg.adapt import PyFormat, Transformer


class Native:
    """A statement as libpq takes it: the name it is prepared under on each connection,
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


def round_trip(pgconn: Any, expected: int) -> Any:
    """psycopg's generator protocol: write libpq's buffer, then read ``expected``
    statements' results and the Sync's; each statement's last result, in order."""
    yield from generators.send(pgconn)
    out = []
    for _ in range(expected + 1):
        results = yield from generators.fetch_many(pgconn)
        if not results:  # libpq has nothing more to give: the session is gone
            raise psycopg.OperationalError("the server sent fewer results than statements")
        out.append(results[-1])
    return out
