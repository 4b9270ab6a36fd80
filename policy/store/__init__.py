"""The policy store: tenants, API keys, identity providers, role bindings, models, policies.

SQLite by default, PostgreSQL at scale; schema by Alembic (``migrations/``);
secrets encrypted at rest with AES-256-GCM (``crypto``, ``types``).
Open it with ``PolicyStore.open(settings, data_dir)``.

The names below are imported on first use: the server's settings import
``StoreSettings`` from here, and ``inferctl --help`` should not pay for
loading SQLAlchemy and Alembic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from policy.lazy import lazy_exports

if TYPE_CHECKING:
    from policy.store.config import StoreSettings
    from policy.store.records import (
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
    from policy.store.repository import PLATFORM_TENANT, UNSET, PolicyStore

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "policy.store.config": ("StoreSettings",),
        "policy.store.repository": ("PLATFORM_TENANT", "UNSET", "PolicyStore"),
        "policy.store.records": (
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
