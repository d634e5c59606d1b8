"""fleet-wide limits: each limit key's lock row and pause, concurrency slots, the
requests and tokens of the last minute, the steps waiting for room

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fleet_limit_state",
        sa.Column("limit_key", sa.String(length=400), primary_key=True),
        sa.Column("paused_until", sa.Float(), nullable=True),
    )
    op.create_table(
        "fleet_limit_slots",
        sa.Column("limit_key", sa.String(length=400), primary_key=True),
        sa.Column("run_id", sa.String(length=200), primary_key=True),
        sa.Column("step_id", sa.String(length=300), primary_key=True),
        sa.Column("token", sa.String(length=64), nullable=False),
        sa.Column("acquired_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
    )
    op.create_table(
        "fleet_limit_events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("limit_key", sa.String(length=400), nullable=False),
        sa.Column("token", sa.String(length=64), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("tenant", sa.String(length=200), nullable=False),
    )
    op.create_index("ix_limit_events_key_at", "fleet_limit_events", ["limit_key", "at"])
    op.create_index("ix_limit_events_token", "fleet_limit_events", ["token"])
    op.create_table(
        "fleet_limit_waits",
        sa.Column("limit_key", sa.String(length=400), primary_key=True),
        sa.Column("run_id", sa.String(length=200), primary_key=True),
        sa.Column("step_id", sa.String(length=300), primary_key=True),
        sa.Column("why", sa.String(length=20), nullable=False),
        sa.Column("since", sa.Float(), nullable=False),
        sa.Column("seen_at", sa.Float(), nullable=False),
        sa.Column("due_at", sa.Float(), nullable=False),
        sa.Column("tenant", sa.String(length=200), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("fleet_limit_waits")
    op.drop_index("ix_limit_events_token", table_name="fleet_limit_events")
    op.drop_index("ix_limit_events_key_at", table_name="fleet_limit_events")
    op.drop_table("fleet_limit_events")
    op.drop_table("fleet_limit_slots")
    op.drop_table("fleet_limit_state")
