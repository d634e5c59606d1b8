"""the operator's console: the audit of actions, a run's tenant, the run list's and the
incident buckets' indexes

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# The console lists runs newest first, keyset on (created_at, id), alone or filtered by
# one of status, workflow or tenant: one index per shape, so a page is an index range.
RUN_LIST_INDEXES = {
    "ix_runs_created": ["created_at", "id"],
    "ix_runs_status_created": ["status", "created_at", "id"],
    "ix_runs_workflow_created": ["workflow", "created_at", "id"],
    "ix_runs_tenant_created": ["tenant", "created_at", "id"],
}


def upgrade() -> None:
    op.create_table(
        "fleet_audit",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("action", sa.String(length=40), nullable=False),
        sa.Column("run_id", sa.String(length=200), nullable=True),
        sa.Column("target", sa.String(length=300), nullable=True),
        sa.Column("why", sa.Text(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
    )
    op.create_index("ix_audit_run_at", "fleet_audit", ["run_id", "at"])
    op.create_index("ix_audit_at", "fleet_audit", ["at"])
    with op.batch_alter_table("fleet_runs") as batch:
        batch.add_column(sa.Column("tenant", sa.String(length=200), nullable=True))
    for name, columns in RUN_LIST_INDEXES.items():
        op.create_index(name, "fleet_runs", columns)
    op.create_index("ix_incidents_at", "fleet_incidents", ["at"])


def downgrade() -> None:
    op.drop_index("ix_incidents_at", table_name="fleet_incidents")
    for name in RUN_LIST_INDEXES:
        op.drop_index(name, table_name="fleet_runs")
    with op.batch_alter_table("fleet_runs") as batch:
        batch.drop_column("tenant")
    op.drop_index("ix_audit_at", table_name="fleet_audit")
    op.drop_index("ix_audit_run_at", table_name="fleet_audit")
    op.drop_table("fleet_audit")
