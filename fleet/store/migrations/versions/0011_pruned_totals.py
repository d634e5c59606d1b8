"""the totals retention keeps of the rows it deletes (fleet_pruned_totals), so the
metrics' counters never go back after a prune

Per counter and label set (a JSON list of the label values), the sum of what the
metrics counted from the deleted rows; added to in the transaction of each prune
(fleet/store/totals.py). Runs pruned before this revision are not counted.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-14
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fleet_pruned_totals",
        sa.Column("counter", sa.String(length=100), primary_key=True),
        sa.Column("labels", sa.Text(), primary_key=True),
        sa.Column("value", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("fleet_pruned_totals")
