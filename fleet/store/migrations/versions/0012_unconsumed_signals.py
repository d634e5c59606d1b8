"""an index of the signals no wait has consumed yet (fleet_signals.consumed_at IS NULL),
for the sweeper's look for a kept signal whose wait is pending

A signal sent while its wait is being recorded can be missed by both hand-overs (the
sender's finds no pending wait, the recording advance finds no signal: neither sees
the other's uncommitted write); the sweeper hands such a signal over
(fleet/worker/sweeper.py). Few signals are unconsumed at a time, so the partial index
keeps that look cheap however many signals the table holds.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-15
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

UNCONSUMED = sa.text("consumed_at IS NULL")


def upgrade() -> None:
    op.create_index(
        "ix_signals_unconsumed",
        "fleet_signals",
        ["run_id", "name"],
        postgresql_where=UNCONSUMED,
        sqlite_where=UNCONSUMED,
    )


def downgrade() -> None:
    op.drop_index("ix_signals_unconsumed", table_name="fleet_signals")
