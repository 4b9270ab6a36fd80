"""Models loaded through the admin API keep their ``embedding`` section (issue 21: pooling, normalize, matryoshka).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # NULL: the defaults (mean pooling, normalised, no Matryoshka cuts), as for a model loaded before.
    with op.batch_alter_table("served_models") as batch:
        batch.add_column(sa.Column("embedding", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("served_models") as batch:
        batch.drop_column("embedding")
