"""The audit log: events indexed from each replica's audit spool.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("chain_id", sa.String(64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=True),
        sa.Column("principal", sa.String(255), nullable=True),
        sa.Column("decision", sa.String(16), nullable=False),
        sa.Column("route", sa.String(255), nullable=True),
        sa.Column("model", sa.String(255), nullable=True),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("record", sa.JSON(), nullable=False),  # the whole spooled record, re-verifiable
        sa.PrimaryKeyConstraint("id", name="pk_audit_events"),
        sa.UniqueConstraint("chain_id", "seq", name="uq_audit_events_chain_id_seq"),
    )
    op.create_index("ix_audit_events_at", "audit_events", ["at"])
    op.create_index("ix_audit_events_tenant_id_at", "audit_events", ["tenant_id", "at"])
    op.create_index("ix_audit_events_tenant_id_principal_at", "audit_events", ["tenant_id", "principal", "at"])
    op.create_index("ix_audit_events_tenant_id_decision_at", "audit_events", ["tenant_id", "decision", "at"])


def downgrade() -> None:
    op.drop_table("audit_events")
