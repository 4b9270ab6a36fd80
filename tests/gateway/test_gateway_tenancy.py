"""Tenant isolation: another tenant's objects answer 404, exactly like ones that do not exist."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from policy.store import PolicyStore, StoreSettings

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data_dir: Path = tmp_path_factory.mktemp("tenancy")
    store = PolicyStore.open(StoreSettings(), data_dir)
    admin = store.ensure_bootstrap_admin()
    acme, globex = store.create_tenant("acme"), store.create_tenant("globex")
    acme_admin = store.create_api_key(acme.id, "admin", "tenant-admin")[1]
    globex_key, _ = store.create_api_key(globex.id, "app", "member")
    provider = store.create_oidc_provider("corp", "https://login.example.com", "inferflux")
    globex_binding = store.create_role_binding(
        globex.id, provider_id=provider.id, kind="group", subject="eng", role="member"
    )
    store.record_admin_event(principal="test", action="tenant.touch", target_kind="tenant", tenant_id=globex.id)
    with TestClient(make_app(store)) as client:
        yield {
            "store": store,
            "client": client,
            "admin": {"authorization": f"Bearer {admin}"},
            "acme_admin": {"authorization": f"Bearer {acme_admin}"},
            "acme": acme,
            "globex": globex,
            "globex_key": globex_key,
            "globex_binding": globex_binding,
            "provider": provider,
        }
    store.close()


def requests_on(tenant_id: str, key_id: str, binding_id: str, provider_id: str) -> list[tuple[str, str, Any]]:
    """Every admin request that names a tenant, with a body that would be valid."""
    t = f"/admin/v1/tenants/{tenant_id}"
    return [
        ("GET", t, None),
        ("GET", f"{t}/models", None),
        ("GET", f"{t}/keys", None),
        ("POST", f"{t}/keys", {"name": "x", "role": "member"}),
        ("GET", f"{t}/keys/{key_id}", None),
        ("POST", f"{t}/keys/{key_id}/revoke", None),
        ("POST", f"{t}/keys/{key_id}/rotate", {"grace_seconds": 0}),
        ("GET", f"{t}/role-bindings", None),
        ("POST", f"{t}/role-bindings", {"provider_id": provider_id, "kind": "subject", "subject": "bob", "role": "member"}),
        ("GET", f"{t}/role-bindings/{binding_id}", None),
        ("DELETE", f"{t}/role-bindings/{binding_id}", None),
        ("GET", f"{t}/audit", None),
    ]


def test_another_tenants_objects_are_404_like_missing_ones(world: dict[str, Any]) -> None:
    client, globex = world["client"], world["globex"]
    other = requests_on(globex.id, world["globex_key"].id, world["globex_binding"].id, world["provider"].id)
    missing = requests_on("ten_doesnotexist00", "key_doesnotexist00", "rb_doesnotexist000", world["provider"].id)
    for (method, path, body), (_, missing_path, _) in zip(other, missing, strict=True):
        seen = client.request(method, path, json=body, headers=world["acme_admin"])
        absent = client.request(method, missing_path, json=body, headers=world["acme_admin"])
        assert seen.status_code == 404, (method, path, seen.text)
        assert absent.status_code == 404, (method, missing_path, absent.text)
        # Same shape and code: nothing tells the caller which of the two it hit.
        assert seen.json()["error"]["code"] == absent.json()["error"]["code"] == "not_found"
        assert seen.json()["error"]["type"] == absent.json()["error"]["type"]
        assert globex.id not in seen.json()["error"]["message"] or "ten_doesnotexist00" in absent.json()["error"]["message"]
    # Nothing was changed by any of it.
    store = world["store"]
    assert store.get_api_key(globex.id, world["globex_key"].id).revoked_at is None
    assert store.get_role_binding(globex.id, world["globex_binding"].id).role == "member"
    assert [k.name for k in store.list_api_keys(globex.id).items] == ["app"]


def test_own_tenant_path_with_another_tenants_ids_is_404(world: dict[str, Any]) -> None:
    client, acme = world["client"], world["acme"]
    t = f"/admin/v1/tenants/{acme.id}"
    for method, path in [
        ("GET", f"{t}/keys/{world['globex_key'].id}"),
        ("POST", f"{t}/keys/{world['globex_key'].id}/revoke"),
        ("POST", f"{t}/keys/{world['globex_key'].id}/rotate"),
        ("GET", f"{t}/role-bindings/{world['globex_binding'].id}"),
        ("DELETE", f"{t}/role-bindings/{world['globex_binding'].id}"),
    ]:
        response = client.request(method, path, headers=world["acme_admin"])
        assert response.status_code == 404, (method, path, response.text)
    assert world["store"].get_api_key(world["globex"].id, world["globex_key"].id).revoked_at is None


def test_tenant_admin_sees_only_its_own_audit_and_keys(world: dict[str, Any]) -> None:
    client, acme = world["client"], world["acme"]
    created = client.post(
        f"/admin/v1/tenants/{acme.id}/keys", json={"name": "ci", "role": "viewer"}, headers=world["acme_admin"]
    )
    assert created.status_code == 201
    events = client.get(f"/admin/v1/tenants/{acme.id}/audit?limit=200", headers=world["acme_admin"]).json()["data"]
    assert events and {e["tenant_id"] for e in events} == {acme.id}
    assert any(e["action"] == "key.create" and e["target_id"] == created.json()["id"] for e in events)
    keys = client.get(f"/admin/v1/tenants/{acme.id}/keys", headers=world["acme_admin"]).json()["data"]
    assert {k["tenant_id"] for k in keys} == {acme.id}


def test_tenant_admin_cannot_escalate(world: dict[str, Any]) -> None:
    client, acme = world["client"], world["acme"]
    for role in ("platform-admin",):
        response = client.post(
            f"/admin/v1/tenants/{acme.id}/keys", json={"name": "x", "role": role}, headers=world["acme_admin"]
        )
        assert response.status_code == 403, response.text
        response = client.post(
            f"/admin/v1/tenants/{acme.id}/role-bindings",
            json={"provider_id": world["provider"].id, "kind": "subject", "subject": "eve", "role": role},
            headers=world["acme_admin"],
        )
        assert response.status_code == 403, response.text
    # Nor may it widen its tenant's model allow-list or rename itself into another tenant.
    assert client.put(f"/admin/v1/tenants/{acme.id}/models", json={"allowed_models": None},
                      headers=world["acme_admin"]).status_code == 403
    assert client.patch(f"/admin/v1/tenants/{acme.id}", json={"disabled": False},
                        headers=world["acme_admin"]).status_code == 403
    # The platform admin cannot hand platform-admin to an ordinary tenant either.
    response = client.post(
        f"/admin/v1/tenants/{acme.id}/keys", json={"name": "x", "role": "platform-admin"}, headers=world["admin"]
    )
    assert response.status_code == 422 and response.json()["error"]["param"] == "role"


def test_platform_tenant_cannot_be_deleted_or_disabled(world: dict[str, Any]) -> None:
    client = world["client"]
    platform = world["store"].get_tenant_by_name("platform")
    assert client.delete(f"/admin/v1/tenants/{platform.id}", headers=world["admin"]).status_code == 409
    assert client.patch(f"/admin/v1/tenants/{platform.id}", json={"disabled": True},
                        headers=world["admin"]).status_code == 409


def test_model_allow_lists(world: dict[str, Any]) -> None:
    client, store = world["client"], world["store"]
    tenant = store.create_tenant("initech", allowed_models=[])
    _, key = store.create_api_key(tenant.id, "app", "member")
    headers = {"authorization": f"Bearer {key}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    def visible() -> list[str]:
        return [m["id"] for m in client.get("/v1/models", headers=headers).json()["data"]]

    assert visible() == []
    for path, kwargs in [("/v1/chat/completions", {"json": chat}), (f"/v1/models/{MODEL}", {}),
                         ("/v1/models/smollm2", {})]:  # by alias too
        method = "POST" if "json" in kwargs else "GET"
        response = client.request(method, path, headers=headers, **kwargs)
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found", path
    # The same 404 as a model that does not exist at all.
    missing = client.post("/v1/chat/completions", headers=headers, json={**chat, "model": "no-such-model"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

    # The platform admin allows the model; effective at once on this replica.
    allowed = client.put(f"/admin/v1/tenants/{tenant.id}/models", json={"allowed_models": [MODEL]},
                         headers=world["admin"])
    assert allowed.status_code == 200
    assert visible() == [MODEL]
    assert client.post("/v1/chat/completions", headers=headers, json=chat).status_code == 200

    # A key's own list narrows the tenant's; it cannot widen it.
    _, narrow = store.create_api_key(tenant.id, "narrow", "member", allowed_models=[])
    response = client.post("/v1/chat/completions", headers={"x-api-key": narrow}, json=chat)
    assert response.status_code == 404
    assert client.put(f"/admin/v1/tenants/{tenant.id}/models", json={"allowed_models": ["nope"]},
                      headers=world["admin"]).status_code == 422


def test_disabled_tenant_is_locked_out(world: dict[str, Any]) -> None:
    client, store = world["client"], world["store"]
    tenant = store.create_tenant("umbrella")
    _, key = store.create_api_key(tenant.id, "app", "member")
    assert client.get("/v1/models", headers={"x-api-key": key}).status_code == 200
    assert client.patch(f"/admin/v1/tenants/{tenant.id}", json={"disabled": True},
                        headers=world["admin"]).status_code == 200
    response = client.get("/v1/models", headers={"x-api-key": key})
    assert response.status_code == 401
