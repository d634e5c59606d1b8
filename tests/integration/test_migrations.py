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


def test_a_state_outside_the_lists_is_refused_and_the_lists_are_whole(backend: Backend) -> None:
    """Each state column refuses a value outside its list (an IN list on SQLite, a cast
    to an enum type on Postgres, migration 0010), and takes every value of its enum in
    fleet/states.py: the two never drift apart."""
    from fleet.states import AttemptOutcome, RunStatus, StepKind, StepStatus

    lists = {
        ("fleet_runs", "status"): RunStatus,
        ("fleet_steps", "status"): StepStatus,
        ("fleet_steps", "kind"): StepKind,
        ("fleet_attempts", "outcome"): AttemptOutcome,
    }
    db = Database(backend.database_url)
    try:
        migrate.upgrade(db)
        for (table, column), states in lists.items():
            for value in [*(s.value for s in states), "bogus"]:
                ok = _accepts(db, table, column, value)
                assert ok == (value != "bogus"), (table, column, value)
    finally:
        db.dispose()


def _accepts(db: Database, table: str, column: str, value: str) -> bool:
    """Whether a row of ``table`` may hold ``value`` in ``column`` (the row written in a
    transaction that is rolled back either way)."""
    from sqlalchemy import text

    rows = {
        "fleet_runs": (
            "INSERT INTO fleet_runs (id, workflow, version, pins, args, queue, status,"
            " wake_seq, advanced_seq, dispatches, created_at, updated_at, detached)"
            " VALUES ('r', 'w', '1', '{}', '[]', 'q', :v, 0, 0, 0, 0, 0, false)"
        ),
        "fleet_steps": (
            "INSERT INTO fleet_steps (run_id, step_id, seq, name, kind, input, status,"
            " attempts, max_attempts, epoch, dispatches, created_at)"
            " VALUES ('r', 's', 1, 'n', :kind, '[]', :status, 0, 1, 0, 0, 0)"
        ),
        "fleet_attempts": (
            "INSERT INTO fleet_attempts (run_id, step_id, epoch, attempt, worker, outcome,"
            " started_at, calls, input_tokens, output_tokens, cost)"
            " VALUES ('r', 's', 1, 1, 'w', :v, 0, 0, 0, 0, 0)"
        ),
    }
    params = {"v": value, "kind": "task", "status": "pending"}
    if table == "fleet_steps":
        params[column] = value
    conn = db.engine.connect()
    tx = conn.begin()
    try:
        conn.execute(text(rows["fleet_runs"]), {"v": "running"})
        if table == "fleet_runs":
            conn.execute(text("UPDATE fleet_runs SET status = :v"), {"v": value})
        else:
            conn.execute(text(rows[table]), params)
        return True
    except Exception as exc:  # noqa: BLE001 - refused: the message names the value
        assert value in str(exc), exc
        return False
    finally:
        tx.rollback()
        conn.close()
