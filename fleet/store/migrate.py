"""Create or migrate the schema with Alembic (``fleet db upgrade``), and check that a
store is at the code's revision before anything reads or writes it.

The rule: only ``fleet db upgrade`` (and, for the embedded SQLite store, the commands
that start work: a worker, ``enqueue``) may create or change a store's schema. Every
other command finds the store as it is, reads it without changing it, and says in one
line what to do when it is missing, older or newer than the code.
"""

from __future__ import annotations

import functools
import sqlite3
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.exc import DBAPIError, OperationalError

from fleet.errors import StoreUnavailable
from fleet.store.engine import Database, describe_driver_error, redact, sqlite_path

MIGRATIONS = Path(__file__).with_name("migrations")
# As named in migrations/env.py.
VERSION_TABLE = "fleet_alembic_version"
# A store with fleet's tables but no revision recorded (made by hand, or half-made).
UNRECORDED = "none recorded"


def alembic_config(db: Database) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["engine"] = db.engine
    return cfg


def upgrade(db: Database, revision: str = "head") -> None:
    _refuse_unknown(db, current(db))
    try:
        command.upgrade(alembic_config(db), revision)
    except OperationalError as exc:
        raise StoreUnavailable(describe_driver_error(db.url, exc)) from exc


@functools.cache
def _scripts() -> ScriptDirectory:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(cfg)


def head() -> str:
    """The newest revision the code has a migration for, read from the scripts."""
    return ",".join(sorted(_scripts().get_heads()))


def known_revisions() -> set[str]:
    return {script.revision for script in _scripts().walk_revisions()}


def current(db: Database) -> str | None:
    """The store's revision; None if it has no fleet schema (or, for SQLite, no file).
    Reading it changes nothing: a SQLite file is opened read-only."""
    path = sqlite_path(db.url)
    if path is not None:
        return _sqlite_revision(db.url, path) if path.exists() else None
    try:
        with db.engine.connect() as conn:
            tables = set(inspect(conn).get_table_names())
            if VERSION_TABLE not in tables:
                return UNRECORDED if "fleet_runs" in tables else None
            rows = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars()
            return ",".join(sorted(rows)) or UNRECORDED
    except DBAPIError as exc:
        raise StoreUnavailable(describe_driver_error(db.url, exc)) from exc


def _sqlite_revision(url: str, path: Path) -> str | None:
    # Not through the engine: its connections switch the file to WAL mode, a change to
    # a file that may not be fleet's at all.
    try:
        conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=30)
    except sqlite3.Error as exc:
        raise StoreUnavailable(f"store {redact(url)} unavailable: {exc}") from exc
    try:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        if VERSION_TABLE not in tables:
            return UNRECORDED if "fleet_runs" in tables else None
        rows = [row[0] for row in conn.execute(f"SELECT version_num FROM {VERSION_TABLE}")]
        return ",".join(sorted(rows)) or UNRECORDED
    except sqlite3.Error as exc:
        raise StoreUnavailable(f"store {redact(url)} unavailable: {exc}") from exc
    finally:
        conn.close()


def check(db: Database, *, create: bool) -> None:
    """The store is at the code's revision, or ``StoreUnavailable`` in one line naming
    what to do. With ``create``, a missing or older schema is migrated instead."""
    found, needed = current(db), head()
    if found == needed:
        return
    where = redact(db.url)
    if found == UNRECORDED:
        raise StoreUnavailable(
            f"store {where} has fleet tables but no schema revision in {VERSION_TABLE}: "
            "it was not made by `fleet db upgrade`"
        )
    _refuse_unknown(db, found)
    if create:
        upgrade(db)
        return
    if found is None:
        path = sqlite_path(db.url)
        if path is not None and not path.exists():
            raise StoreUnavailable(
                f"store {where} does not exist: create it with `fleet db upgrade` "
                "(or by starting a worker or enqueueing a run)"
            )
        raise StoreUnavailable(f"store {where} has no fleet schema: run `fleet db upgrade`")
    raise StoreUnavailable(
        f"store {where} is at schema revision {found}, this fleet needs {needed}: "
        "run `fleet db upgrade`"
    )


def _refuse_unknown(db: Database, found: str | None) -> None:
    """A store migrated by a newer fleet: this code must neither use nor migrate it."""
    if found is not None and found != UNRECORDED and found not in known_revisions():
        raise StoreUnavailable(
            f"store {redact(db.url)} is at schema revision {found}, which this fleet does "
            f"not know (its newest is {head()}): run a fleet as new as the store's"
        )
