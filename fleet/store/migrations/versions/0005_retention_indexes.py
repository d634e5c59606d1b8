"""retention indexes: finished runs by age, incidents by run

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_runs_status_finished", "fleet_runs", ["status", "finished_at"])
    op.create_index("ix_incidents_run", "fleet_incidents", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_incidents_run", table_name="fleet_incidents")
    op.drop_index("ix_runs_status_finished", table_name="fleet_runs")
