"""children and fan-outs: a run's parent, child steps, fan-out settle counts

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

STEP_KIND_OLD = "kind IN ('task', 'value', 'wait')"
STEP_KIND_NEW = "kind IN ('task', 'value', 'wait', 'child')"


def _kinds(check: str) -> None:
    with op.batch_alter_table("fleet_steps") as batch:
        batch.drop_constraint("ck_steps_kind", type_="check")
        batch.create_check_constraint("ck_steps_kind", check)


def upgrade() -> None:
    with op.batch_alter_table("fleet_runs") as batch:
        batch.add_column(sa.Column("parent_id", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("parent_step", sa.String(length=300), nullable=True))
        batch.add_column(
            sa.Column("detached", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.create_index("ix_runs_parent", ["parent_id"])
    with op.batch_alter_table("fleet_steps") as batch:
        batch.add_column(sa.Column("fanout", sa.Integer(), nullable=True))
    _kinds(STEP_KIND_NEW)
    op.create_table(
        "fleet_fanouts",
        sa.Column("run_id", sa.String(length=200), primary_key=True),
        sa.Column("fanout", sa.Integer(), primary_key=True),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("settled", sa.Integer(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("fleet_fanouts")
    op.execute("DELETE FROM fleet_steps WHERE kind = 'child'")
    _kinds(STEP_KIND_OLD)
    with op.batch_alter_table("fleet_steps") as batch:
        batch.drop_column("fanout")
    with op.batch_alter_table("fleet_runs") as batch:
        batch.drop_index("ix_runs_parent")
        batch.drop_column("detached")
        batch.drop_column("parent_step")
        batch.drop_column("parent_id")
