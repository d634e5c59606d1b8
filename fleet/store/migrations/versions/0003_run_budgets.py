"""run budgets: spend limits and the reason a run waits for a decision

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("fleet_runs") as batch:
        batch.add_column(sa.Column("budget_tokens", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("budget_cost", sa.Float(), nullable=True))
        batch.add_column(sa.Column("decision", sa.String(length=20), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("fleet_runs") as batch:
        batch.drop_column("decision")
        batch.drop_column("budget_cost")
        batch.drop_column("budget_tokens")
