"""Role bindings: a role in a tenant for an OIDC subject or group of one identity provider.

A binding counts only where its provider may sign users in, so a binding for
a provider that may not (another tenant's, say) is refused when it is made.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.store import validate
from inferflux.policy.store.models import OidcProvider, RoleBinding, Tenant
from inferflux.policy.store.records import Page, RoleBindingRecord
from inferflux.policy.store.repos.base import (
    PLATFORM_ADMIN,
    PLATFORM_TENANT,
    Repository,
    flush_or_conflict,
    get_owned_row,
    get_tenant_row,
)
from inferflux.policy.store.repos.identity_providers import provider_bounds
from inferflux.policy.store.repos.mapper import RecordMapper
from inferflux.policy.store.types import new_id

BINDING_KINDS = ("subject", "group")

ROLE_BINDING = RecordMapper(RoleBinding, RoleBindingRecord)


class RoleBindingRepository(Repository):
    def create_role_binding(
        self, tenant_id: str, *, provider_id: str, kind: str, subject: str, role: str
    ) -> RoleBindingRecord:
        if kind not in BINDING_KINDS:
            raise ValidationFailed(f"kind must be one of {', '.join(BINDING_KINDS)}", param="kind")
        validate.text(subject, "subject", 512)
        validate.role(role)
        row = RoleBinding(
            id=new_id("rb"),
            tenant_id=tenant_id,
            provider_id=provider_id,
            kind=kind,
            subject=subject,
            role=role,
            created_at=self._now(),
        )
        with self._write() as session:
            tenant = get_tenant_row(session, tenant_id)
            _check_binding_provider(session, tenant, provider_id, role)
            session.add(row)
            flush_or_conflict(
                session, f"The {kind} '{subject}' of this provider already has a role binding in this tenant"
            )
            return self._record(ROLE_BINDING, row)

    def get_role_binding(self, tenant_id: str, binding_id: str) -> RoleBindingRecord:
        with self._read() as session:
            row = get_owned_row(session, RoleBinding, binding_id, tenant_id, "role binding")
            return self._record(ROLE_BINDING, row)

    def list_role_bindings(
        self, tenant_id: str, limit: int = 50, after: str | None = None, *, provider_id: str | None = None
    ) -> Page[RoleBindingRecord]:
        with self._read() as session:
            query = select(RoleBinding).where(RoleBinding.tenant_id == tenant_id)
            if provider_id is not None:
                query = query.where(RoleBinding.provider_id == provider_id)
            return self._page(session, query, ROLE_BINDING, limit, after)

    def delete_role_binding(self, tenant_id: str, binding_id: str) -> None:
        with self._write() as session:
            session.delete(get_owned_row(session, RoleBinding, binding_id, tenant_id, "role binding"))

    def find_role_bindings(
        self, provider_id: str, tenant_id: str, subject: str, groups: Iterable[str] = ()
    ) -> frozenset[str]:
        """The roles bound in ``tenant_id`` to this provider's ``subject`` or any of its ``groups``."""
        groups = list(groups)
        match = and_(RoleBinding.kind == "subject", RoleBinding.subject == subject)
        if groups:
            match = or_(match, and_(RoleBinding.kind == "group", RoleBinding.subject.in_(groups)))
        with self._read() as session:
            roles = session.scalars(
                select(RoleBinding.role).where(
                    RoleBinding.provider_id == provider_id, RoleBinding.tenant_id == tenant_id, match
                )
            ).all()
        return frozenset(roles)


def _check_binding_provider(session: Session, tenant: Tenant, provider_id: str, role: str) -> None:
    """A binding counts only where its provider may sign users in: a provider that may not (another
    tenant's, say) is answered exactly as one that does not exist."""
    if role == PLATFORM_ADMIN and tenant.name != PLATFORM_TENANT:
        raise ValidationFailed("platform-admin can be bound only in the platform tenant", param="role")
    # In the platform tenant, the bounds require allow_platform, which platform-admin needs too.
    provider = session.get(OidcProvider, provider_id)
    if provider is None or not provider_bounds(provider).admits(tenant.id, is_platform=tenant.name == PLATFORM_TENANT):
        raise ValidationFailed(
            f"unknown identity provider '{provider_id}', or one that may not sign users into this tenant",
            param="provider_id",
        )
