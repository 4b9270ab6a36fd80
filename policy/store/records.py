"""What the store hands out: frozen snapshots, never ORM objects.

A record cannot lazy-load, cannot be flushed back by accident, and is safe to
cache and share across threads. Lists come back as tuples; secrets are
decrypted but kept out of ``repr`` so a logged record does not leak them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar

from inferflux.policy.authn.bounds import TenantBounds

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a list; pass ``next_cursor`` as ``after`` for the next (None: last page)."""

    items: tuple[T, ...]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class TenantRecord:
    id: str
    name: str
    display_name: str | None
    disabled: bool
    allowed_models: tuple[str, ...] | None  # None: every model
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    """An API key's metadata; the key itself is shown once, and its hash never leaves the store."""

    id: str
    tenant_id: str
    prefix: str
    name: str
    role: str
    allowed_models: tuple[str, ...] | None  # None: the tenant's list
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None
    replaced_by: str | None
    created_by: str

    def is_usable(self, now: datetime) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


@dataclass(frozen=True, slots=True)
class RoleBindingRecord:
    id: str
    tenant_id: str
    provider_id: str
    kind: str  # "subject" | "group"
    subject: str
    role: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class OidcProviderRecord:
    id: str
    tenant_id: str | None  # the owning tenant; None: platform-owned
    tenant_ids: tuple[str, ...]  # platform-owned: the tenants it may map users into
    allow_platform: bool  # platform-owned: the platform tenant (and platform-admin) too
    name: str
    issuer: str
    audience: str
    client_id: str | None
    client_secret: str | None = field(repr=False)
    jwks_uri: str | None
    algorithms: tuple[str, ...]
    tenant_claim: str
    roles_claim: str
    role_map: dict[str, str]
    required_claims: tuple[str, ...]
    leeway_seconds: int
    enabled: bool
    created_at: datetime
    updated_at: datetime

    def bounds(self) -> TenantBounds:
        """The tenants its tokens may sign users into."""
        return TenantBounds(self.tenant_id, frozenset(self.tenant_ids), self.allow_platform)


@dataclass(frozen=True, slots=True)
class ServedModelRecord:
    id: str
    name: str
    path: str
    backend: str
    dtype: str
    aliases: tuple[str, ...]
    is_default: bool
    created_at: datetime
    updated_at: datetime
    upstream: dict[str, Any] | None = None
    embedding: dict[str, Any] | None = None
    deterministic: bool = False
    passes: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class PolicyRecord:
    id: str
    tenant_id: str | None  # None: applies to every tenant
    kind: str
    name: str
    spec: dict[str, Any]
    sensitive_spec: str | None = field(repr=False)
    enabled: bool
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class CredentialRecord:
    id: str
    tenant_id: str | None
    name: str
    secret: str = field(repr=False)
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class AdminEventRecord:
    id: str
    tenant_id: str | None
    at: datetime
    principal: str
    action: str
    target_kind: str
    target_id: str | None
    detail: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class RotationReport:
    """What ``rotate_key`` did."""

    active_version: int
    previous_versions: tuple[int, ...]
    rows: int  # rows with at least one value re-encrypted
    values: int  # values re-encrypted
    pruned_versions: tuple[int, ...]
