"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fleet_attempts",
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("step_id", sa.String(length=300), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=200), nullable=False),
        sa.Column("outcome", sa.String(length=20), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("model", sa.String(length=200), nullable=True),
        sa.Column("calls", sa.Integer(), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("cost", sa.Float(), nullable=False),
        sa.CheckConstraint(
            "outcome IN ('running', 'done', 'failed', 'fenced', 'lost')", name="ck_attempts_outcome"
        ),
        sa.PrimaryKeyConstraint("run_id", "step_id", "epoch"),
    )
    op.create_table(
        "fleet_dead_letters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("step_id", sa.String(length=300), nullable=False),
        sa.Column("workflow", sa.String(length=200), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("input", sa.Text(), nullable=False),
        sa.Column("error_type", sa.String(length=200), nullable=False),
        sa.Column("error_message", sa.Text(), nullable=False),
        sa.Column("traceback", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("first_failed_at", sa.Float(), nullable=False),
        sa.Column("last_failed_at", sa.Float(), nullable=False),
        sa.Column("replayed_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("fleet_dead_letters", schema=None) as batch_op:
        batch_op.create_index("ix_dead_letters_run", ["run_id"], unique=False)

    op.create_table(
        "fleet_incidents",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=30), nullable=False),
        sa.Column("run_id", sa.String(length=200), nullable=True),
        sa.Column("step_id", sa.String(length=300), nullable=True),
        sa.Column("epoch", sa.Integer(), nullable=True),
        sa.Column("worker", sa.String(length=200), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("at", sa.Float(), nullable=False),
        sa.CheckConstraint(
            "kind IN ('fenced_write', 'duplicate_delivery', 'takeover', 'nondeterminism', 'unknown_step', 'malformed_message')",
            name="ck_incidents_kind",
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("fleet_incidents", schema=None) as batch_op:
        batch_op.create_index("ix_incidents_kind", ["kind"], unique=False)

    op.create_table(
        "fleet_runs",
        sa.Column("id", sa.String(length=200), nullable=False),
        sa.Column("workflow", sa.String(length=200), nullable=False),
        sa.Column("version", sa.String(length=100), nullable=False),
        sa.Column("pins", sa.Text(), nullable=False),
        sa.Column("args", sa.Text(), nullable=False),
        sa.Column("queue", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("result", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("wake_seq", sa.Integer(), nullable=False),
        sa.Column("advanced_seq", sa.Integer(), nullable=False),
        sa.Column("redispatch_at", sa.Float(), nullable=True),
        sa.Column("dispatches", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'waiting', 'needs_decision', 'succeeded', 'failed', 'cancelled')",
            name="ck_runs_status",
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("fleet_runs", schema=None) as batch_op:
        batch_op.create_index("ix_runs_status", ["status"], unique=False)

    op.create_table(
        "fleet_steps",
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("step_id", sa.String(length=300), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=10), nullable=False),
        sa.Column("input", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("output", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=200), nullable=True),
        sa.Column("lease_expires_at", sa.Float(), nullable=True),
        sa.Column("due_at", sa.Float(), nullable=True),
        sa.Column("redispatch_at", sa.Float(), nullable=True),
        sa.Column("dispatches", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.CheckConstraint("kind IN ('task', 'value')", name="ck_steps_kind"),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'retry_wait', 'done', 'dead')", name="ck_steps_status"
        ),
        sa.CheckConstraint("attempts >= 0 AND epoch >= 0", name="ck_steps_counters"),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["fleet_runs.id"],
        ),
        sa.PrimaryKeyConstraint("run_id", "step_id"),
        sa.UniqueConstraint("run_id", "seq", name="uq_steps_seq"),
    )
    with op.batch_alter_table("fleet_steps", schema=None) as batch_op:
        batch_op.create_index("ix_steps_status", ["status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("fleet_steps", schema=None) as batch_op:
        batch_op.drop_index("ix_steps_status")

    op.drop_table("fleet_steps")
    with op.batch_alter_table("fleet_runs", schema=None) as batch_op:
        batch_op.drop_index("ix_runs_status")

    op.drop_table("fleet_runs")
    with op.batch_alter_table("fleet_incidents", schema=None) as batch_op:
        batch_op.drop_index("ix_incidents_kind")

    op.drop_table("fleet_incidents")
    with op.batch_alter_table("fleet_dead_letters", schema=None) as batch_op:
        batch_op.drop_index("ix_dead_letters_run")

    op.drop_table("fleet_dead_letters")
    op.drop_table("fleet_attempts")
