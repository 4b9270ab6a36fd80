"""The policy store: tenants, API keys, identity providers, role bindings, models, policies.

SQLite by default, PostgreSQL at scale; schema by Alembic (``migrations/``);
secrets encrypted at rest with AES-256-GCM (``crypto``, ``types``).
Open it with ``PolicyStore.open(settings, data_dir)``.

The names below are imported on first use: the server's settings import
``StoreSettings`` from here, and ``inferctl --help`` should not pay for
loading SQLAlchemy and Alembic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

_EXPORTS = {
    "StoreSettings": "policy.store.config",
    "PolicyStore": "policy.store.repository",
    "PLATFORM_TENANT": "policy.store.repository",
    "UNSET": "policy.store.repository",
    **dict.fromkeys(
        (
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
        "policy.store.records",
    ),
}

__all__ = [
    "PLATFORM_TENANT",
    "UNSET",
    "AdminEventRecord",
    "ApiKeyRecord",
    "CredentialRecord",
    "OidcProviderRecord",
    "Page",
    "PolicyRecord",
    "PolicyStore",
    "RoleBindingRecord",
    "RotationReport",
    "ServedModelRecord",
    "StoreSettings",
    "TenantRecord",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'policy.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
