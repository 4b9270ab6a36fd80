"""Models loaded through the admin API keep their ``deterministic`` flag (issue 22: batch-invariant kernels).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Every model registered before this loaded without it: false.
    with op.batch_alter_table("served_models") as batch:
        batch.add_column(sa.Column("deterministic", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("served_models") as batch:
        batch.drop_column("deterministic")
