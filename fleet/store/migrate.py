"""Create or migrate the schema with Alembic (``fleet db upgrade``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.exc import OperationalError

from fleet.errors import StoreUnavailable
from fleet.store.engine import Database, describe_driver_error

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(db: Database) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["engine"] = db.engine
    return cfg


def upgrade(db: Database, revision: str = "head") -> None:
    try:
        command.upgrade(alembic_config(db), revision)
    except OperationalError as exc:
        raise StoreUnavailable(describe_driver_error(db.url, exc)) from exc
