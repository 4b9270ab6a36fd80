"""Tenants: the unit everything else belongs to.

Deleting a tenant deletes what it owns (the database cascades), and takes it
out of the lists of platform-owned identity providers, which no key cascades.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, func, select

from inferflux.policy.errors import NotFound
from inferflux.policy.store import validate
from inferflux.policy.store.models import OidcProvider, Tenant
from inferflux.policy.store.records import Page, TenantRecord
from inferflux.policy.store.repos.base import UNSET, Repository, Unset, flush_or_conflict, get_tenant_row
from inferflux.policy.store.repos.mapper import RecordMapper, optional
from inferflux.policy.store.types import new_id

TENANT = RecordMapper(Tenant, TenantRecord, allowed_models=optional(tuple))


def new_tenant(name: str, display_name: str | None, allowed_models: list[str] | None, now: datetime) -> Tenant:
    """A tenant row of validated values, not yet added to a session."""
    return Tenant(
        id=new_id("ten"),
        name=name,
        display_name=display_name,
        disabled=False,
        allowed_models=allowed_models,
        created_at=now,
        updated_at=now,
    )


class TenantRepository(Repository):
    def create_tenant(
        self, name: str, display_name: str | None = None, allowed_models: Sequence[str] | None = None
    ) -> TenantRecord:
        validate.slug(name, "name")
        row = new_tenant(
            name,
            validate.display_name(display_name),
            validate.models(allowed_models, "allowed_models"),
            self._now(),
        )
        with self._write() as session:
            session.add(row)
            flush_or_conflict(session, f"A tenant named '{name}' already exists")
            return self._record(TENANT, row)

    def get_tenant(self, tenant_id: str) -> TenantRecord:
        with self._read() as session:
            return self._record(TENANT, get_tenant_row(session, tenant_id))

    def get_tenant_by_name(self, name: str) -> TenantRecord:
        with self._read() as session:
            row = session.scalar(select(Tenant).where(Tenant.name == name))
            if row is None:
                raise NotFound(f"No tenant named '{name}'")
            return self._record(TENANT, row)

    def list_tenants(self, limit: int = 50, after: str | None = None) -> Page[TenantRecord]:
        with self._read() as session:
            return self._page(session, select(Tenant), TENANT, limit, after)

    def count_tenants(self) -> int:
        with self._read() as session:
            return session.scalar(select(func.count()).select_from(Tenant)) or 0

    def update_tenant(
        self,
        tenant_id: str,
        *,
        name: str | Unset = UNSET,
        display_name: str | Unset | None = UNSET,
        disabled: bool | Unset = UNSET,
        allowed_models: Sequence[str] | Unset | None = UNSET,
    ) -> TenantRecord:
        with self._write() as session:
            row = get_tenant_row(session, tenant_id)
            if not isinstance(name, Unset):
                row.name = validate.slug(name, "name")
            if not isinstance(display_name, Unset):
                row.display_name = validate.display_name(display_name)
            if not isinstance(disabled, Unset):
                row.disabled = validate.boolean(disabled, "disabled")
            if not isinstance(allowed_models, Unset):
                row.allowed_models = validate.models(allowed_models, "allowed_models")
            row.updated_at = self._now()
            flush_or_conflict(session, f"A tenant named '{row.name}' already exists")
            return self._record(TENANT, row)

    def delete_tenant(self, tenant_id: str) -> None:
        """Delete the tenant with its keys, role bindings, identity providers, policies and credentials."""
        with self._write() as session:
            get_tenant_row(session, tenant_id)
            session.execute(delete(Tenant).where(Tenant.id == tenant_id))  # the database cascades
            # Platform-owned providers name the tenants they map into in a list, which no key cascades.
            for provider in session.scalars(select(OidcProvider).where(OidcProvider.tenant_id.is_(None))):
                if tenant_id in provider.tenant_ids:
                    provider.tenant_ids = [t for t in provider.tenant_ids if t != tenant_id]
