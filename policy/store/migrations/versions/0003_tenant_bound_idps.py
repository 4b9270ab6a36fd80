"""Identity providers bound to tenants (issue 18).

A provider now belongs to one tenant (``tenant_id``) or is platform-owned
(NULL) with the tenants it may map users into (``tenant_ids``) and whether it
may sign users into the platform tenant, platform-admin included
(``allow_platform``). Before this, every provider could map users into every
tenant.

Existing providers become platform-owned with the mapping they had in
practice, so that nothing that worked stops working, and nothing new is
allowed:

* ``tenant_ids``: every tenant that exists now except the platform tenant
  (tenants made later must be added explicitly);
* ``allow_platform``: true only where the provider already reached the
  platform tenant on purpose: its role map names ``platform-admin``, or it has
  a role binding in the platform tenant.

(issuer, audience) becomes the unique pair (was: issuer), and names are
unique per owner (was: globally).

Downgrading would make tenant-owned providers global again, a widening no one
asked for; it refuses while any provider is tenant-owned or shares an issuer
or a name with another.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

from inferflux.policy.errors import StoreConfigError

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger("inferflux.migrations")

PLATFORM_TENANT = "platform"
PLATFORM_ADMIN = "platform-admin"

_providers = sa.table(
    "oidc_providers",
    sa.column("id", sa.String),
    sa.column("name", sa.String),
    sa.column("issuer", sa.String),
    sa.column("role_map", sa.JSON),
    sa.column("tenant_id", sa.String),
    sa.column("tenant_ids", sa.JSON),
    sa.column("allow_platform", sa.Boolean),
)
_tenants = sa.table("tenants", sa.column("id", sa.String), sa.column("name", sa.String))
_bindings = sa.table("role_bindings", sa.column("provider_id", sa.String), sa.column("tenant_id", sa.String))


def upgrade() -> None:
    with op.batch_alter_table("oidc_providers") as batch:
        batch.add_column(sa.Column("tenant_id", sa.String(32), nullable=True))
        batch.add_column(sa.Column("tenant_ids", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("allow_platform", sa.Boolean(), nullable=True))
    _map_existing_providers(op.get_bind())
    with op.batch_alter_table("oidc_providers") as batch:
        batch.alter_column("tenant_ids", existing_type=sa.JSON(), nullable=False)
        batch.alter_column("allow_platform", existing_type=sa.Boolean(), nullable=False)
        batch.drop_constraint("uq_oidc_providers_name", type_="unique")
        batch.drop_constraint("uq_oidc_providers_issuer", type_="unique")
        batch.create_unique_constraint("uq_oidc_providers_tenant_id_name", ["tenant_id", "name"])
        batch.create_unique_constraint("uq_oidc_providers_issuer_audience", ["issuer", "audience"])
        batch.create_foreign_key(
            "fk_oidc_providers_tenant_id_tenants", "tenants", ["tenant_id"], ["id"], ondelete="CASCADE"
        )
        batch.create_index("ix_oidc_providers_tenant_id", ["tenant_id"])


def _role_map(value: Any) -> dict[str, str]:
    # JSON columns come back decoded on PostgreSQL and, depending on the driver, as text on SQLite.
    return json.loads(value) if isinstance(value, str) else dict(value or {})


def _map_existing_providers(connection: sa.Connection) -> None:
    tenants = connection.execute(sa.select(_tenants.c.id, _tenants.c.name)).all()
    platform = {tenant_id for tenant_id, name in tenants if name == PLATFORM_TENANT}
    ordinary = sorted(tenant_id for tenant_id, name in tenants if name != PLATFORM_TENANT)
    bound_in_platform = set(
        connection.scalars(sa.select(_bindings.c.provider_id).where(_bindings.c.tenant_id.in_(platform)))
    )
    for provider_id, name, role_map in connection.execute(
        sa.select(_providers.c.id, _providers.c.name, _providers.c.role_map)
    ).all():
        allow_platform = PLATFORM_ADMIN in _role_map(role_map).values() or provider_id in bound_in_platform
        connection.execute(
            _providers.update()
            .where(_providers.c.id == provider_id)
            .values(tenant_id=None, tenant_ids=ordinary, allow_platform=allow_platform)
        )
        log.warning(
            "identity provider %s (%s) is now platform-owned, mapping users into the %d existing tenants%s; "
            "review its tenant_ids and allow_platform",
            name, provider_id, len(ordinary), " and the platform tenant" if allow_platform else "",
        )  # fmt: skip


def downgrade() -> None:
    _check_downgradable(op.get_bind())
    with op.batch_alter_table("oidc_providers") as batch:
        batch.drop_index("ix_oidc_providers_tenant_id")
        batch.drop_constraint("fk_oidc_providers_tenant_id_tenants", type_="foreignkey")
        batch.drop_constraint("uq_oidc_providers_issuer_audience", type_="unique")
        batch.drop_constraint("uq_oidc_providers_tenant_id_name", type_="unique")
        batch.create_unique_constraint("uq_oidc_providers_issuer", ["issuer"])
        batch.create_unique_constraint("uq_oidc_providers_name", ["name"])
        batch.drop_column("allow_platform")
        batch.drop_column("tenant_ids")
        batch.drop_column("tenant_id")


def _check_downgradable(connection: sa.Connection) -> None:
    rows = connection.execute(sa.select(_providers.c.tenant_id, _providers.c.issuer, _providers.c.name)).all()
    owned = sum(1 for tenant_id, _, _ in rows if tenant_id is not None)
    issuers = [issuer for _, issuer, _ in rows]
    names = [name for _, _, name in rows]
    if owned or len(set(issuers)) != len(issuers) or len(set(names)) != len(names):
        raise StoreConfigError(
            "cannot downgrade below 0003: revision 0002 has only global identity providers with unique "
            f"issuers and names; delete the {owned} tenant-owned provider(s) and those sharing an issuer "
            "or a name first"
        )
