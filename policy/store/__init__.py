"""The policy store: tenants, API keys, identity providers, role bindings, models, policies.

SQLite by default, PostgreSQL at scale; schema by Alembic (its ``migrations/``, read by ``migrate``);
secrets encrypted at rest with AES-256-GCM (``crypto``, ``types``).
Open it with ``PolicyStore.open(settings, data_dir)``.

The names below are imported on first use: the server's settings import
``StoreSettings`` from here, and ``inferctl --help`` should not pay for
loading SQLAlchemy and Alembic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferflux.policy.lazy import lazy_exports

if TYPE_CHECKING:
    from inferflux.policy.store.config import StoreSettings
    from inferflux.policy.store.records import (
        AdminEventRecord,
        ApiKeyRecord,
        CredentialRecord,
        OidcProviderRecord,
        Page,
        PolicyRecord,
        RoleBindingRecord,
        RotationReport,
        ServedModelRecord,
        TenantRecord,
    )
    from inferflux.policy.store.repository import PLATFORM_TENANT, UNSET, PolicyStore

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "inferflux.policy.store.config": ("StoreSettings",),
        "inferflux.policy.store.repository": ("PLATFORM_TENANT", "UNSET", "PolicyStore"),
        "inferflux.policy.store.records": (
            "AdminEventRecord",
            "ApiKeyRecord",
            "CredentialRecord",
            "OidcProviderRecord",
            "Page",
            "PolicyRecord",
            "RoleBindingRecord",
            "RotationReport",
            "ServedModelRecord",
            "TenantRecord",
        ),
    },
)
