"""Signed audit checkpoints copied from each spool (issue 18).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_checkpoints",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("chain_id", sa.String(64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),  # the last record the checkpoint covers
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("signature", sa.String(64), nullable=False),  # HMAC-SHA256, hex
        sa.PrimaryKeyConstraint("id", name="pk_audit_checkpoints"),
        # Also the index of "the latest checkpoint of a chain".
        sa.UniqueConstraint("chain_id", "seq", name="uq_audit_checkpoints_chain_id_seq"),
    )


def downgrade() -> None:
    op.drop_table("audit_checkpoints")
