"""Indexes for the admin API's largest lists, at platform scale (issue 20).

Lists are paged by (created_at, id) behind a keyset cursor
(``policy.store.pagination``). With no index in that order, every page of the
tenants list sorted all the tenants, and a page of a tenant's keys sorted all
of that tenant's keys. Measured by ``benchmarks/bench_store_scale.py`` on
100,000 tenants and 1,000,000 keys: a page of tenants took 19-74 ms in the
database (a sequential scan and a sort; the machine was loaded),
``GET /admin/v1/tenants?limit=50`` 23-34 ms at p50 against 6 ms on an empty
store; a page of the keys of a tenant holding 10,000 sorted them all
(2.4-3.8 ms), a cost that grows with the tenant.

* ``tenants (created_at, id)``: the tenants list;
* ``api_keys (tenant_id, created_at, id)``: a tenant's keys. It replaces the
  index on ``tenant_id`` alone, whose uses (the cascade from a deleted tenant)
  its first column serves, so a key written updates no more indexes than before.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_tenants_created_at_id", "tenants", ["created_at", "id"])
    op.create_index("ix_api_keys_tenant_id_created_at_id", "api_keys", ["tenant_id", "created_at", "id"])
    op.drop_index("ix_api_keys_tenant_id", table_name="api_keys")


def downgrade() -> None:
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.drop_index("ix_api_keys_tenant_id_created_at_id", table_name="api_keys")
    op.drop_index("ix_tenants_created_at_id", table_name="tenants")
