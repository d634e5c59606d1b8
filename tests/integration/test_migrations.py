"""The migrations build exactly the tables ``fleet/store/schema.py`` declares: a column,
index or constraint added to one and not the other fails here, on both stores."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from fleet.store import migrate, schema
from fleet.store.engine import Database
from tests.harness import Backend


def test_the_migrated_store_matches_the_declared_schema(backend: Backend) -> None:
    db = Database(backend.database_url)
    try:
        migrate.upgrade(db)
        with db.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), schema.metadata)
    finally:
        db.dispose()
    # Alembic's own bookkeeping table is the one table the models do not declare.
    diff = [
        d for d in diff if not (d[0] == "remove_table" and d[1].name == "fleet_alembic_version")
    ]
    assert diff == []
