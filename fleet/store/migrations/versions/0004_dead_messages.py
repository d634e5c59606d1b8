"""dead messages: broker messages that were not fleet's, set aside once for an operator

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fleet_dead_messages",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("queue", sa.String(length=200), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("fleet_dead_messages")
