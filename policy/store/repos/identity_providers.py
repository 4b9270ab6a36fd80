"""OIDC identity providers: a tenant's own, or the platform's with the tenants it may map users into.

``owner`` in the methods below: UNSET for any provider (platform admins), else
the owning tenant's id, or None for the platform-owned ones; a provider of
another owner is answered exactly as a missing one.

The rules a provider must meet (``_check_provider``) are checked on every
write, since they span rows: the owner, the tenants it maps into, the roles it
may grant, and the (issuer, audience) pair tokens are routed by.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from inferflux.policy.authn.bounds import TenantBounds
from inferflux.policy.errors import Conflict, ValidationFailed
from inferflux.policy.store import validate
from inferflux.policy.store.models import OidcProvider, Tenant
from inferflux.policy.store.records import OidcProviderRecord, Page
from inferflux.policy.store.repos.base import (
    PLATFORM_ADMIN,
    PLATFORM_TENANT,
    UNSET,
    Repository,
    Unset,
    check_owner_exists,
    flush_or_conflict,
    get_owned_row,
    get_row,
    owned_by,
)
from inferflux.policy.store.repos.mapper import RecordMapper, optional
from inferflux.policy.store.types import new_id

# Whose identity providers a call may reach: a tenant's id, None (the platform's), or UNSET (any).
OwnerFilter = str | Unset | None

DEFAULT_ALGORITHMS = ("RS256", "ES256", "EdDSA")
# What one entry of the unique (issuer, audience) index may hold; PostgreSQL refuses entries over ~2.7 kB.
MAX_ISSUER_AUDIENCE_BYTES = 2048

OIDC_PROVIDER = RecordMapper(
    OidcProvider,
    OidcProviderRecord,
    tenant_ids=tuple,
    algorithms=tuple,
    role_map=dict,
    required_claims=tuple,
)

# How each field a caller sets is checked, the same for a new provider and a change.
_FIELD_CHECKS: dict[str, Callable[[Any], Any]] = {
    "tenant_ids": lambda value: validate.strings(value, "tenant_ids"),
    "allow_platform": lambda value: validate.boolean(value, "allow_platform"),
    "name": lambda value: validate.slug(value, "name"),
    "issuer": lambda value: validate.url(value, "issuer"),
    "audience": lambda value: validate.text(value, "audience", 2048),
    "client_id": lambda value: validate.optional_text(value, "client_id", 255),
    "client_secret": optional(validate.secret),  # sealed by the caller, with the row's id
    "jwks_uri": optional(lambda value: validate.url(value, "jwks_uri")),
    "algorithms": validate.algorithms,
    "tenant_claim": lambda value: validate.text(value, "tenant_claim", 255),
    "roles_claim": lambda value: validate.text(value, "roles_claim", 255),
    "role_map": validate.role_map,
    "required_claims": lambda value: validate.strings(value, "required_claims"),
    "leeway_seconds": validate.leeway,
    "enabled": lambda value: validate.boolean(value, "enabled"),
}


def _checked(**values: Any) -> dict[str, Any]:
    """The fields given (not UNSET), checked in the order given."""
    return {name: _FIELD_CHECKS[name](value) for name, value in values.items() if not isinstance(value, Unset)}


class IdentityProviderRepository(Repository):
    def create_oidc_provider(
        self,
        name: str,
        issuer: str,
        audience: str,
        *,
        tenant_id: str | None = None,
        tenant_ids: Sequence[str] = (),
        allow_platform: bool = False,
        client_id: str | None = None,
        client_secret: str | None = None,
        jwks_uri: str | None = None,
        algorithms: Sequence[str] = DEFAULT_ALGORITHMS,
        tenant_claim: str = "tenant",
        roles_claim: str = "roles",
        role_map: Mapping[str, str] | None = None,
        required_claims: Sequence[str] = (),
        leeway_seconds: int = 30,
        enabled: bool = True,
    ) -> OidcProviderRecord:
        """A provider of ``tenant_id`` (mapping users into it alone), or platform-owned (None)
        mapping users into ``tenant_ids`` and, with ``allow_platform``, the platform tenant."""
        fields = _checked(
            name=name,
            tenant_ids=tenant_ids,
            allow_platform=allow_platform,
            issuer=issuer,
            audience=audience,
            client_id=client_id,
            jwks_uri=jwks_uri,
            algorithms=algorithms,
            tenant_claim=tenant_claim,
            roles_claim=roles_claim,
            role_map=role_map,
            required_claims=required_claims,
            leeway_seconds=leeway_seconds,
            enabled=enabled,
        )
        now = self._now()
        row = OidcProvider(id=new_id("idp"), tenant_id=tenant_id, **fields, created_at=now, updated_at=now)
        with self._write() as session:
            check_owner_exists(session, tenant_id)
            _check_provider(session, row)
            if client_secret is not None:
                row.client_secret = self._keys.seal(session, row, "client_secret", validate.secret(client_secret))
            session.add(row)
            flush_or_conflict(
                session, f"An identity provider named '{name}' or with this issuer and audience already exists"
            )
            return self._record(OIDC_PROVIDER, row)

    def get_oidc_provider(self, provider_id: str, *, owner: OwnerFilter = UNSET) -> OidcProviderRecord:
        with self._read() as session:
            return self._record(OIDC_PROVIDER, _provider(session, provider_id, owner))

    def list_oidc_providers(
        self, limit: int = 50, after: str | None = None, *, owner: OwnerFilter = UNSET
    ) -> Page[OidcProviderRecord]:
        query = select(OidcProvider)
        if not isinstance(owner, Unset):
            query = query.where(owned_by(OidcProvider, owner))
        with self._read() as session:
            return self._page(session, query, OIDC_PROVIDER, limit, after)

    def list_enabled_oidc_providers(self) -> list[OidcProviderRecord]:
        """Every enabled provider, for the token verifier (a handful; not paginated)."""
        with self._read() as session:
            rows = session.scalars(
                select(OidcProvider).where(OidcProvider.enabled.is_(True)).order_by(OidcProvider.created_at)
            ).all()
            return [self._record(OIDC_PROVIDER, row) for row in rows]

    def update_oidc_provider(
        self,
        provider_id: str,
        *,
        owner: OwnerFilter = UNSET,
        tenant_ids: Sequence[str] | Unset = UNSET,
        allow_platform: bool | Unset = UNSET,
        name: str | Unset = UNSET,
        issuer: str | Unset = UNSET,
        audience: str | Unset = UNSET,
        client_id: str | Unset | None = UNSET,
        client_secret: str | Unset | None = UNSET,
        jwks_uri: str | Unset | None = UNSET,
        algorithms: Sequence[str] | Unset = UNSET,
        tenant_claim: str | Unset = UNSET,
        roles_claim: str | Unset = UNSET,
        role_map: Mapping[str, str] | Unset = UNSET,
        required_claims: Sequence[str] | Unset = UNSET,
        leeway_seconds: int | Unset = UNSET,
        enabled: bool | Unset = UNSET,
    ) -> OidcProviderRecord:
        """Change a provider; its owner never changes (delete it and register it again)."""
        with self._write() as session:
            row = _provider(session, provider_id, owner)
            changes = _checked(
                tenant_ids=tenant_ids,
                allow_platform=allow_platform,
                name=name,
                issuer=issuer,
                audience=audience,
                client_id=client_id,
                client_secret=client_secret,
                jwks_uri=jwks_uri,
                algorithms=algorithms,
                tenant_claim=tenant_claim,
                roles_claim=roles_claim,
                role_map=role_map,
                required_claims=required_claims,
                leeway_seconds=leeway_seconds,
                enabled=enabled,
            )
            secret = changes.pop("client_secret", UNSET)
            if not isinstance(secret, Unset):
                row.client_secret = None if secret is None else self._keys.seal(session, row, "client_secret", secret)
            for field, value in changes.items():
                setattr(row, field, value)
            _check_provider(session, row)
            row.updated_at = self._now()
            flush_or_conflict(
                session, f"Another identity provider has the name '{row.name}' or this issuer and audience"
            )
            return self._record(OIDC_PROVIDER, row)

    def delete_oidc_provider(self, provider_id: str, *, owner: OwnerFilter = UNSET) -> None:
        """Delete the provider and every role binding made for it."""
        with self._write() as session:
            _provider(session, provider_id, owner)
            session.execute(delete(OidcProvider).where(OidcProvider.id == provider_id))


def provider_bounds(row: OidcProvider) -> TenantBounds:
    """The tenants the provider's tokens may sign users into."""
    return TenantBounds(row.tenant_id, frozenset(row.tenant_ids), row.allow_platform)


def _provider(session: Session, provider_id: str, owner: OwnerFilter) -> OidcProvider:
    """The provider, if ``owner`` owns it (UNSET: whoever does); another owner's answers as a missing one."""
    if isinstance(owner, Unset):
        return get_row(session, OidcProvider, provider_id, "identity provider")
    return get_owned_row(session, OidcProvider, provider_id, owner, "identity provider")


# -- the rules a provider row must meet ----------------------------------------------------


def _check_provider(session: Session, row: OidcProvider) -> None:
    """Every rule a provider row must meet, before it is written."""
    _check_provider_owner(session, row)
    _check_provider_tenants(session, row)
    _check_provider_roles(row)
    _check_issuer_audience_size(row)
    _check_issuer_free(session, row.issuer, row.audience, exclude_id=row.id)
    _check_provider_name_free(session, row)


def _check_provider_owner(session: Session, row: OidcProvider) -> None:
    """The platform tenant's users come only from platform-owned providers that say so (allow_platform)."""
    if row.tenant_id is None:
        return
    owner = session.get(Tenant, row.tenant_id)
    if owner is not None and owner.name == PLATFORM_TENANT:
        raise ValidationFailed(
            "the platform tenant cannot own an identity provider; register a platform-owned one "
            "with allow_platform instead",
            param="tenant_id",
        )


def _check_provider_tenants(session: Session, row: OidcProvider) -> None:
    """A tenant's provider maps into its tenant alone; a platform-owned one into existing, ordinary tenants."""
    if row.tenant_id is not None:
        if row.tenant_ids or row.allow_platform:
            raise ValidationFailed(
                "tenant_ids and allow_platform are for platform-owned providers; a tenant's provider "
                "maps users into its own tenant only",
                param="tenant_ids" if row.tenant_ids else "allow_platform",
            )
        return
    found = {t.id: t.name for t in session.scalars(select(Tenant).where(Tenant.id.in_(row.tenant_ids)))}
    unknown = [t for t in row.tenant_ids if t not in found]
    if unknown:
        raise ValidationFailed(f"unknown tenant(s): {', '.join(unknown)}", param="tenant_ids")
    if PLATFORM_TENANT in found.values():
        raise ValidationFailed("the platform tenant is reached with allow_platform, not tenant_ids", param="tenant_ids")


def _check_provider_roles(row: OidcProvider) -> None:
    if PLATFORM_ADMIN in row.role_map.values() and not provider_bounds(row).grants_platform_admin:
        raise ValidationFailed(
            "only a platform-owned provider with allow_platform may map a claim to platform-admin", param="role_map"
        )


def _check_issuer_audience_size(row: OidcProvider) -> None:
    if len(row.issuer.encode()) + len(row.audience.encode()) > MAX_ISSUER_AUDIENCE_BYTES:
        raise ValidationFailed(
            f"issuer and audience together must be at most {MAX_ISSUER_AUDIENCE_BYTES} bytes (UTF-8)",
            param="audience",
        )


def _check_issuer_free(session: Session, issuer: str, audience: str, *, exclude_id: str) -> None:
    """Tokens are routed to a provider by (issuer, audience) (``policy.authn.oidc``), and issuers that
    differ only in a trailing slash are one issuer there: two such providers would be ambiguous."""
    query = select(OidcProvider.issuer).where(OidcProvider.audience == audience, OidcProvider.id != exclude_id)
    for other in session.scalars(query):
        if other.rstrip("/") == issuer.rstrip("/"):
            raise Conflict(f"An identity provider with issuer '{other}' and this audience already exists")


def _check_provider_name_free(session: Session, row: OidcProvider) -> None:
    # The database's unique (tenant_id, name) does not cover platform-owned rows: NULLs never collide.
    query = select(OidcProvider.id).where(
        owned_by(OidcProvider, row.tenant_id), OidcProvider.name == row.name, OidcProvider.id != row.id
    )
    if session.scalar(query.limit(1)) is not None:
        raise Conflict(f"An identity provider named '{row.name}' already exists")
