"""Models served by upstream servers: the registry keeps their ``upstream`` section (issue 20).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # NULL for a model whose weights are here; no secret in it (a credential is named, not held).
    with op.batch_alter_table("served_models") as batch:
        batch.add_column(sa.Column("upstream", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("served_models") as batch:
        batch.drop_column("upstream")
