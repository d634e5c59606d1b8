"""on Postgres, the CHECK constraints on the states a step, a run and an attempt can be
in, checked by casting to an enum type instead of by an IN list

Postgres rebuilds a table's CHECK expressions from their stored text at every statement
that writes the table, and an IN list's constant array is stored a byte at a time:
the four lists cost 17 % of Postgres's CPU per step (bench.many_runs, 0.90 ms → 0.73 ms
a step without them, bench/RESULTS.md §2). A cast to an enum type (``(status::text)::
fleet_step_status IS NOT NULL``) refuses the same values ("invalid input value for enum
fleet_step_status") from a few nodes. The columns stay strings, and SQLite keeps its
IN lists (schema.py). A later migration that changes a list adds the value to the enum
(``ALTER TYPE … ADD VALUE``).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# (table, constraint, column): the enum type and its values, as the IN lists of 0001,
# 0002 and 0007 have them.
_CHECKS = {
    ("fleet_steps", "ck_steps_status", "status"): (
        "fleet_step_status",
        ("pending", "running", "retry_wait", "in_doubt", "done", "dead"),
    ),
    ("fleet_steps", "ck_steps_kind", "kind"): (
        "fleet_step_kind",
        ("task", "value", "wait", "child"),
    ),
    ("fleet_runs", "ck_runs_status", "status"): (
        "fleet_run_status",
        ("queued", "running", "waiting", "needs_decision", "succeeded", "failed", "cancelled"),
    ),
    ("fleet_attempts", "ck_attempts_outcome", "outcome"): (
        "fleet_attempt_outcome",
        ("running", "done", "failed", "fenced", "lost"),
    ),
}


def _listed(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for (table, name, column), (enum, values) in _CHECKS.items():
        op.execute(f"CREATE TYPE {enum} AS ENUM ({_listed(values)})")
        # NOT VALID, then VALIDATE: the rows already there are checked without holding
        # the table's exclusive lock for the scan.
        op.execute(
            f"ALTER TABLE {table} DROP CONSTRAINT {name}, "
            f"ADD CONSTRAINT {name} CHECK (({column}::text)::{enum} IS NOT NULL) NOT VALID"
        )
        op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {name}")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for (table, name, column), (enum, values) in _CHECKS.items():
        op.execute(
            f"ALTER TABLE {table} DROP CONSTRAINT {name}, "
            f"ADD CONSTRAINT {name} CHECK ({column} IN ({_listed(values)}))"
        )
        op.execute(f"DROP TYPE {enum}")
