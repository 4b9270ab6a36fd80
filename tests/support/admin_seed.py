"""A policy store seeded for admin API tests: the platform admin, two tenants with their admins, an identity provider."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from http_helpers import bearer


@dataclass
class Seeded:
    store: Any  # policy.store.PolicyStore
    admin: dict[str, str]  # the platform admin's headers
    admin_subject: str  # "key:<prefix>", as its events name it
    acme: Any
    acme_admin: dict[str, str]  # a tenant-admin of acme
    acme_admin_subject: str
    acme_member: Any  # the record of a member key of acme
    globex: Any
    globex_admin: dict[str, str]
    provider: Any  # a platform-owned OIDC provider that may sign users into acme and globex

    def seeded(self) -> dict[str, Any]:
        """The fields above, to build a subclass's instance from this one."""
        return {f.name: getattr(self, f.name) for f in fields(Seeded)}


def seed_store(data_dir: Path) -> Seeded:
    """A new store under ``data_dir`` (SQLite), bootstrapped and seeded."""
    from inferflux.policy.store import PolicyStore, StoreSettings

    store = PolicyStore.open(StoreSettings(), data_dir)
    admin = store.ensure_bootstrap_admin()
    assert admin is not None
    admin_record = store.list_api_keys(store.get_tenant_by_name("platform").id).items[0]
    acme, globex = store.create_tenant("acme"), store.create_tenant("globex")
    acme_record, acme_admin = store.create_api_key(acme.id, "admin", "tenant-admin")
    acme_member, _ = store.create_api_key(acme.id, "app", "member")
    _, globex_admin = store.create_api_key(globex.id, "admin", "tenant-admin")
    # Platform-owned, mapping users into both tenants (role bindings are made in either).
    provider = store.create_oidc_provider("corp", "https://login.example.com", "inferflux", tenant_ids=[acme.id, globex.id])
    return Seeded(store, bearer(admin), f"key:{admin_record.prefix}", acme, bearer(acme_admin),
                  f"key:{acme_record.prefix}", acme_member, globex, bearer(globex_admin), provider)  # fmt: skip


@contextmanager
def seeded_app(make_app: Any, data_dir: Path) -> Iterator[tuple[Seeded, Any, Any]]:
    """(seeded store, started app, its TestClient); the app's own data (audit spool, ...) is ``data_dir/app``."""
    from starlette.testclient import TestClient

    seeded = seed_store(data_dir)
    app = make_app(seeded.store, data_dir=data_dir / "app")
    try:
        with TestClient(app) as client:
            yield seeded, app, client
    finally:
        seeded.store.close()
