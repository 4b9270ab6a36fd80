"""Credential names unique per owner (issue 20).

A model's upstream names the credential it presents (``upstream.credential:
vllm-fleet``), so a name must lead to one credential: unique among a tenant's
(``uq_credentials_tenant_id_name``) and among the platform's, which a unique
constraint does not cover since NULL tenant ids never collide in one: a
partial unique index over the names of the rows without a tenant
(``uq_credentials_platform_name``; PostgreSQL and SQLite both have them).

Nothing wrote credentials before this revision but the store's own API, so a
store should hold no two of one owner with one name; if it does, the upgrade
refuses and says which, rather than pick one of them for the operator.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from inferflux.policy.errors import StoreConfigError

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_credentials = sa.table("credentials", sa.column("tenant_id", sa.String), sa.column("name", sa.String))
_PLATFORM_ROWS = sa.text("tenant_id IS NULL")


def upgrade() -> None:
    _check_no_duplicates(op.get_bind())
    with op.batch_alter_table("credentials") as batch:
        batch.create_unique_constraint("uq_credentials_tenant_id_name", ["tenant_id", "name"])
    op.create_index("uq_credentials_platform_name", "credentials", ["name"], unique=True,
                    postgresql_where=_PLATFORM_ROWS, sqlite_where=_PLATFORM_ROWS)  # fmt: skip


def _check_no_duplicates(connection: sa.Connection) -> None:
    # GROUP BY puts the NULL tenant ids in one group: the platform's duplicates are found too.
    count = sa.func.count()
    query = (sa.select(_credentials.c.tenant_id, _credentials.c.name, count)
             .group_by(_credentials.c.tenant_id, _credentials.c.name).having(count > 1))  # fmt: skip
    duplicates = connection.execute(query).all()
    if duplicates:
        named = ", ".join(f"{name!r} ({tenant_id or 'platform'}: {n})" for tenant_id, name, n in duplicates)
        raise StoreConfigError(
            "cannot migrate to 0006: credential names become unique per owner, and these are not: "
            f"{named}; rename or delete all but one of each first"
        )


def downgrade() -> None:
    op.drop_index("uq_credentials_platform_name", table_name="credentials")
    with op.batch_alter_table("credentials") as batch:
        batch.drop_constraint("uq_credentials_tenant_id_name", type_="unique")
