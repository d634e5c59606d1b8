"""transcripts: a run's messages, appended once, and the compactions beside them

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fleet_messages",
        sa.Column("run_id", sa.String(length=200), primary_key=True),
        sa.Column("transcript", sa.String(length=200), primary_key=True),
        sa.Column("pos", sa.Integer(), primary_key=True),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("step_id", sa.String(length=300), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_table(
        "fleet_compactions",
        sa.Column("run_id", sa.String(length=200), primary_key=True),
        sa.Column("transcript", sa.String(length=200), primary_key=True),
        sa.Column("number", sa.Integer(), primary_key=True),
        sa.Column("start", sa.Integer(), nullable=False),
        sa.Column("upto", sa.Integer(), nullable=False),
        sa.Column("base", sa.Integer(), nullable=True),
        sa.Column("step_id", sa.String(length=300), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("fleet_compactions")
    op.drop_table("fleet_messages")
