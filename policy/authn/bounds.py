"""Which tenants an identity provider may sign users into.

A provider either belongs to one tenant (registered by that tenant's admin,
or by a platform admin for it) and speaks for that tenant alone, or it is
platform-owned and names the tenants it may map users into. A token's tenant
claim is honoured only inside that set: otherwise any IdP administrator could
make its users members of every tenant by writing another tenant's name into
a claim.

The ``platform`` tenant, and with it the ``platform-admin`` role, is never in
a tenant-owned provider's set, and is in a platform-owned provider's set only
when that provider says so (``allow_platform``). Default deny: bounds built
with no arguments admit nobody.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TenantBounds:
    owner: str | None = None  # the owning tenant's id; None: platform-owned
    tenant_ids: frozenset[str] = field(default_factory=frozenset)  # platform-owned: where it may map users
    allow_platform: bool = False  # platform-owned: the platform tenant and platform-admin too

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenant_ids", frozenset(self.tenant_ids))

    def admits(self, tenant_id: str, *, is_platform: bool) -> bool:
        """Whether a token of this provider may sign a user into ``tenant_id``."""
        if is_platform:
            return self.owner is None and self.allow_platform
        if self.owner is not None:
            return tenant_id == self.owner
        return tenant_id in self.tenant_ids

    @property
    def grants_platform_admin(self) -> bool:
        """Whether its role map or bindings may make platform admins (in the platform tenant only)."""
        return self.owner is None and self.allow_platform
