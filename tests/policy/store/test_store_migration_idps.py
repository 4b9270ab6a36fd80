"""Migration 0003: identity providers become tenant-bound, existing ones platform-owned with the mapping
they had in practice (every ordinary tenant; the platform tenant only where they already reached it on
purpose), on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError

from inferflux.policy.errors import StoreConfigError
from inferflux.policy.store import StoreSettings, migrate
from inferflux.policy.store.db import create_store_engine

NOW = datetime(2026, 11, 24, tzinfo=UTC)


@pytest.fixture
def engine(store_settings: StoreSettings, data_dir: Path) -> Iterator[Engine]:
    data_dir.mkdir()
    engine = create_store_engine(store_settings.database_url(data_dir), store_settings)
    migrate.upgrade(engine, "0002")
    yield engine
    engine.dispose()


def table(engine: Engine, name: str) -> sa.Table:
    return sa.Table(name, sa.MetaData(), autoload_with=engine)


def add_tenant(engine: Engine, tenant_id: str, name: str) -> None:
    row = {"id": tenant_id, "name": name, "disabled": False, "created_at": NOW, "updated_at": NOW}
    with engine.begin() as connection:
        connection.execute(table(engine, "tenants").insert().values(**row))


def add_provider(engine: Engine, provider_id: str, issuer: str, role_map: dict[str, str], **extra: Any) -> None:
    row = {
        "id": provider_id, "name": provider_id, "issuer": issuer, "audience": "inferflux", "algorithms": ["RS256"],
        "tenant_claim": "tenant", "roles_claim": "roles", "role_map": role_map, "required_claims": [],
        "leeway_seconds": 30, "enabled": True, "created_at": NOW, "updated_at": NOW, **extra,
    }  # fmt: skip
    with engine.begin() as connection:
        connection.execute(table(engine, "oidc_providers").insert().values(**row))


def add_binding(engine: Engine, binding_id: str, tenant_id: str, provider_id: str) -> None:
    row = {"id": binding_id, "tenant_id": tenant_id, "provider_id": provider_id, "subject": "ops",
           "kind": "group", "role": "member", "created_at": NOW}  # fmt: skip
    with engine.begin() as connection:
        connection.execute(table(engine, "role_bindings").insert().values(**row))


def providers(engine: Engine) -> dict[str, dict[str, Any]]:
    with engine.connect() as connection:
        rows = connection.execute(sa.select(table(engine, "oidc_providers"))).mappings().all()
    return {row["id"]: dict(row) for row in rows}


def test_existing_providers_become_platform_owned_with_their_practical_mapping(engine: Engine) -> None:
    add_tenant(engine, "ten_platform", "platform")
    add_tenant(engine, "ten_acme", "acme")
    add_tenant(engine, "ten_globex", "globex")
    add_provider(engine, "idp_plain", "https://plain.example", {"admin": "tenant-admin"})
    add_provider(engine, "idp_root", "https://root.example", {"root": "platform-admin"})
    add_provider(engine, "idp_bound", "https://bound.example", {})
    add_binding(engine, "rb_ops", "ten_platform", "idp_bound")

    migrate.upgrade(engine, "0003")

    found = providers(engine)
    for provider_id in ("idp_plain", "idp_root", "idp_bound"):
        assert found[provider_id]["tenant_id"] is None  # platform-owned
        assert sorted(found[provider_id]["tenant_ids"]) == ["ten_acme", "ten_globex"]  # never the platform
    # The platform tenant stays reachable only for those that reached it on purpose.
    assert found["idp_plain"]["allow_platform"] is False
    assert found["idp_root"]["allow_platform"] is True  # its role map made platform admins
    assert found["idp_bound"]["allow_platform"] is True  # it had a binding in the platform tenant


def test_issuer_and_audience_are_unique_as_a_pair_and_names_per_owner(engine: Engine) -> None:
    add_tenant(engine, "ten_acme", "acme")
    add_tenant(engine, "ten_globex", "globex")
    migrate.upgrade(engine, "0003")
    bound = {"tenant_ids": [], "allow_platform": False}
    add_provider(engine, "idp_a", "https://shared.example", {}, tenant_id="ten_acme", audience="acme-app", **bound)
    # The same issuer with another audience (one IdP, two tenants' applications), the same name elsewhere.
    add_provider(engine, "idp_b", "https://shared.example", {}, tenant_id="ten_globex", audience="globex-app",
                 name="idp_a", **bound)  # fmt: skip
    with pytest.raises(IntegrityError):
        add_provider(engine, "idp_c", "https://shared.example", {}, tenant_id="ten_globex", audience="acme-app",
                     **bound)  # fmt: skip
    with pytest.raises(IntegrityError):
        add_provider(engine, "idp_d", "https://other.example", {}, tenant_id="ten_acme", name="idp_a", **bound)
    # A tenant's providers go with it.
    with engine.begin() as connection:
        connection.execute(sa.delete(table(engine, "tenants")).where(sa.column("id") == "ten_acme"))
    assert set(providers(engine)) == {"idp_b"}


def test_downgrade_refuses_to_make_tenant_providers_global(engine: Engine) -> None:
    add_tenant(engine, "ten_acme", "acme")
    add_provider(engine, "idp_old", "https://old.example", {})
    migrate.upgrade(engine, "0003")
    add_provider(engine, "idp_acme", "https://acme.example", {}, tenant_id="ten_acme", tenant_ids=[],
                 allow_platform=False)  # fmt: skip
    with pytest.raises(StoreConfigError, match="tenant-owned"):
        migrate.downgrade(engine, "0002")
    assert migrate.current(engine) == "0003"  # nothing was changed
    with engine.begin() as connection:
        connection.execute(sa.delete(table(engine, "oidc_providers")).where(sa.column("id") == "idp_acme"))
    migrate.downgrade(engine, "0002")
    assert set(providers(engine)) == {"idp_old"}
    assert "tenant_id" not in providers(engine)["idp_old"]
    migrate.upgrade(engine, "0003")
    assert providers(engine)["idp_old"]["tenant_ids"] == ["ten_acme"]
