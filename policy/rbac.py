"""Roles, scopes and the authenticated principal.

Roles are what operators assign (to API keys, OIDC subjects and groups);
scopes are what routes require. Keeping the mapping here, in one table, is
what lets a test prove every route × role combination.

Tenancy: every principal belongs to exactly one tenant. Only a
``platform-admin`` may act on other tenants; everyone else who names another
tenant's object gets ``NotFound``, exactly as if it did not exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from inferflux.policy.errors import NotFound, PermissionDenied


class Role(StrEnum):
    PLATFORM_ADMIN = "platform-admin"
    TENANT_ADMIN = "tenant-admin"
    MEMBER = "member"
    VIEWER = "viewer"


class Scope(StrEnum):
    GENERATE = "generate"  # call the models
    READ = "read"  # list models, read one's own identity
    ADMIN_TENANT = "admin:tenant"  # manage one's own tenant: keys, role bindings, audit
    ADMIN_PLATFORM = "admin:platform"  # tenants, identity providers, models, every tenant


ROLE_SCOPES: dict[Role, frozenset[Scope]] = {
    Role.PLATFORM_ADMIN: frozenset(Scope),
    Role.TENANT_ADMIN: frozenset({Scope.GENERATE, Scope.READ, Scope.ADMIN_TENANT}),
    Role.MEMBER: frozenset({Scope.GENERATE, Scope.READ}),
    Role.VIEWER: frozenset({Scope.READ}),
}

ROLE_NAMES: tuple[str, ...] = tuple(role.value for role in Role)


def parse_role(value: str) -> Role:
    try:
        return Role(value)
    except ValueError:
        raise ValueError(f"unknown role {value!r}; roles are {', '.join(ROLE_NAMES)}") from None


def scopes_of(roles: Iterable[str]) -> frozenset[Scope]:
    out: set[Scope] = set()
    for name in roles:
        try:
            out |= ROLE_SCOPES[Role(name)]
        except ValueError:
            continue  # a role this release does not know grants nothing
    return frozenset(out)


@dataclass(frozen=True)
class Principal:
    """Who is calling, as established by authentication, and what it may do."""

    tenant_id: str
    tenant_name: str
    subject: str  # "key:<prefix>" or "oidc:<provider>:<sub>"
    kind: str  # "api_key" | "oidc"
    roles: frozenset[str]
    key_id: str | None = None
    # Model names (canonical) this principal may use; None means every model.
    allowed_models: frozenset[str] | None = None
    scopes: frozenset[Scope] = field(default=frozenset())
    expires_at: float | None = None  # epoch seconds; cached decisions must not outlive it

    def __post_init__(self) -> None:
        if not self.scopes:
            object.__setattr__(self, "scopes", scopes_of(self.roles))

    @property
    def is_platform_admin(self) -> bool:
        return Scope.ADMIN_PLATFORM in self.scopes

    def has(self, scope: Scope) -> bool:
        return scope in self.scopes

    def require(self, scope: Scope) -> None:
        if scope not in self.scopes:
            raise PermissionDenied(f"This credential lacks the '{scope.value}' scope required here")

    def require_tenant(self, tenant_id: str) -> None:
        """Admin access to ``tenant_id``: one's own, or any for a platform admin.

        Answers 404, not 403, so a tenant cannot probe for other tenants' ids.
        """
        if tenant_id != self.tenant_id and not self.is_platform_admin:
            raise NotFound(f"No tenant '{tenant_id}'")

    def may_grant(self, role: str) -> bool:
        """A principal may hand out only roles whose scopes it holds itself."""
        return scopes_of([role]) <= self.scopes

    def may_use_model(self, name: str) -> bool:
        return self.allowed_models is None or name in self.allowed_models


def effective_models(*lists: Iterable[str] | None) -> frozenset[str] | None:
    """Intersect allow-lists (tenant's, key's); None means unrestricted."""
    out: frozenset[str] | None = None
    for models in lists:
        if models is None:
            continue
        out = frozenset(models) if out is None else out & frozenset(models)
    return out
