"""effects, signals, blobs: intents, signals and blobs tables; wait steps, in-doubt
steps and two more incident kinds in the CHECK constraints.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

STEP_STATUS_OLD = "status IN ('pending', 'running', 'retry_wait', 'done', 'dead')"
STEP_STATUS_NEW = "status IN ('pending', 'running', 'retry_wait', 'in_doubt', 'done', 'dead')"
STEP_KIND_OLD = "kind IN ('task', 'value')"
STEP_KIND_NEW = "kind IN ('task', 'value', 'wait')"
_KINDS = "'fenced_write', 'duplicate_delivery', 'takeover', 'nondeterminism', 'unknown_step', 'malformed_message'"
INCIDENT_OLD = f"kind IN ({_KINDS})"
INCIDENT_NEW = f"kind IN ({_KINDS}, 'version_mismatch', 'effect_in_doubt')"


def _checks(steps_status: str, steps_kind: str, incident_kind: str) -> None:
    with op.batch_alter_table("fleet_steps") as batch:
        batch.drop_constraint("ck_steps_status", type_="check")
        batch.drop_constraint("ck_steps_kind", type_="check")
        batch.create_check_constraint("ck_steps_status", steps_status)
        batch.create_check_constraint("ck_steps_kind", steps_kind)
    with op.batch_alter_table("fleet_incidents") as batch:
        batch.drop_constraint("ck_incidents_kind", type_="check")
        batch.create_check_constraint("ck_incidents_kind", incident_kind)


def upgrade() -> None:
    op.create_table(
        "fleet_blobs",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("digest"),
    )
    op.create_table(
        "fleet_intents",
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("step_id", sa.String(length=300), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("idempotency_key", sa.String(length=501), nullable=False),
        sa.Column("input_hash", sa.String(length=64), nullable=False),
        sa.Column("outcome", sa.String(length=20), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("settled_at", sa.Float(), nullable=True),
        sa.CheckConstraint(
            "outcome IN ('open', 'done', 'failed', 'reconciled', 'resolved', 'superseded')",
            name="ck_intents_outcome",
        ),
        sa.PrimaryKeyConstraint("run_id", "step_id", "epoch"),
    )
    op.create_table(
        "fleet_signals",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("consumed_by", sa.String(length=300), nullable=True),
        sa.Column("consumed_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("fleet_signals", schema=None) as batch_op:
        batch_op.create_index("ix_signals_run_name", ["run_id", "name"], unique=False)
    _checks(STEP_STATUS_NEW, STEP_KIND_NEW, INCIDENT_NEW)


def downgrade() -> None:
    # What the old constraints cannot hold is dropped: wait steps and new incident kinds.
    op.execute("DELETE FROM fleet_incidents WHERE kind IN ('version_mismatch', 'effect_in_doubt')")
    op.execute("DELETE FROM fleet_steps WHERE kind = 'wait'")
    op.execute("UPDATE fleet_steps SET status = 'pending' WHERE status = 'in_doubt'")
    _checks(STEP_STATUS_OLD, STEP_KIND_OLD, INCIDENT_OLD)
    with op.batch_alter_table("fleet_signals", schema=None) as batch_op:
        batch_op.drop_index("ix_signals_run_name")

    op.drop_table("fleet_signals")
    op.drop_table("fleet_intents")
    op.drop_table("fleet_blobs")
