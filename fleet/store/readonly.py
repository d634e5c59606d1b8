"""A store opened to read only: connections on which the database itself refuses every
write (a SQLite file opened with ``mode=ro``; Postgres sessions whose transactions are
read only). For what must never change the store whatever code runs in it: a recorded
run replayed in the caller's process (``fleet.testing.replay``)."""

from __future__ import annotations

from urllib.parse import quote

from fleet.errors import BadInput, StoreUnavailable
from fleet.store import migrate
from fleet.store.engine import Database, parse_url, redact, sqlite_path

# A libpq option: every transaction of the session is read only unless it says otherwise
# (fleet's never do: they begin with a plain BEGIN).
PG_READ_ONLY = "-c default_transaction_read_only=on"


def read_only_url(url: str) -> str:
    """``url``, its connections made read-only: on SQLite the file opened by URI with
    ``mode=ro`` (a missing file is ``StoreUnavailable``: never created); on Postgres the
    session's ``default_transaction_read_only`` set at connect."""
    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        path = sqlite_path(url)
        if path is None:
            raise BadInput(f"store {redact(url)} cannot be opened read-only: give its file")
        if not path.is_file():
            raise StoreUnavailable(f"store {redact(url)} unavailable: no such file")
        uri = f"file:{quote(str(path.resolve()))}"
        query = {**parsed.query, "mode": "ro", "uri": "true"}
        return parsed.set(database=uri, query=query).render_as_string(hide_password=False)
    given = parsed.query.get("options") or ()
    options = " ".join([given] if isinstance(given, str) else given)
    query = {**parsed.query, "options": f"{options} {PG_READ_ONLY}".strip()}
    return parsed.set(query=query).render_as_string(hide_password=False)


def read_only(url: str) -> Database:
    """The store at ``url``, read-only (``read_only_url``), found at the code's schema
    revision (``migrate.check``, which changes nothing: a store with no schema or at
    another revision is ``StoreUnavailable`` in one line); dispose it when done."""
    read = read_only_url(url)
    plain = Database(url)  # checked under its own URL, which the messages name
    try:
        migrate.check(plain, create=False)
    finally:
        plain.dispose()
    return Database(read)
