"""Usage and spend (issue 23): model prices, the usage rollup, budget threshold alerts.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "model_prices",
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("prompt_micros_per_million", sa.BigInteger(), nullable=False),
        sa.Column("completion_micros_per_million", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model", name="pk_model_prices"),
    )
    op.create_table(
        "usage_rollup",
        sa.Column("grain", sa.String(8), nullable=False),
        sa.Column("bucket", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_micros", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("grain", "bucket", "tenant_id", "key_id", "model", "reason", name="pk_usage_rollup"),
    )
    op.create_index("ix_usage_rollup_tenant_id_grain_bucket", "usage_rollup", ["tenant_id", "grain", "bucket"])
    op.create_index("ix_usage_rollup_grain_bucket", "usage_rollup", ["grain", "bucket"])
    op.create_table(
        "budget_alerts",
        sa.Column("counter", sa.String(255), nullable=False),
        sa.Column("threshold", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("counter", "threshold", name="pk_budget_alerts"),
    )


def downgrade() -> None:
    op.drop_table("budget_alerts")
    op.drop_index("ix_usage_rollup_grain_bucket", "usage_rollup")
    op.drop_index("ix_usage_rollup_tenant_id_grain_bucket", "usage_rollup")
    op.drop_table("usage_rollup")
    op.drop_table("model_prices")
