"""Models loaded through the admin API keep their load passes (issue 22: quantise, gemm_from).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # NULL for every model registered before: the backend's default passes, as they loaded then.
    with op.batch_alter_table("served_models") as batch:
        batch.add_column(sa.Column("passes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("served_models") as batch:
        batch.drop_column("passes")
