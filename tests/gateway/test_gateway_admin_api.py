"""The admin API's own behaviour: models at run time, pagination, validation, the OpenAPI document."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from backends.models import default_model_path
from gateway.model_admin import ModelAdmin
from gateway.models import ModelManager
from gateway.settings import Settings
from policy.store import PolicyStore, StoreSettings

LOAD_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data_dir: Path = tmp_path_factory.mktemp("admin-api")
    store = PolicyStore.open(StoreSettings(), data_dir)
    admin = store.ensure_bootstrap_admin()
    tenant = store.create_tenant("acme")
    tenant_admin = store.create_api_key(tenant.id, "admin", "tenant-admin")[1]
    app = make_app(store, engine={"kv_cache_bytes": 32 * 1024 * 1024})
    with TestClient(app) as client:
        yield {
            "store": store,
            "app": app,
            "client": client,
            "admin": {"authorization": f"Bearer {admin}"},
            "tenant_admin": {"authorization": f"Bearer {tenant_admin}"},
            "tenant": tenant,
            "data_dir": data_dir,
        }
    store.close()


def wait_loaded(client: TestClient, headers: dict[str, str], name: str) -> dict[str, Any]:
    deadline = time.monotonic() + LOAD_TIMEOUT
    stages = set()
    while True:
        status = client.get(f"/admin/v1/models/{name}", headers=headers).json()
        stages.add(status.get("stage"))
        if status["status"] != "loading":
            status["stages_seen"] = stages
            return status
        assert time.monotonic() < deadline, f"{name} still loading: {status}"
        time.sleep(0.05)


def test_load_serve_default_persist_and_unload_a_model(world: dict[str, Any]) -> None:
    client, admin, store = world["client"], world["admin"], world["store"]
    body = {"name": "second", "path": default_model_path(), "dtype": "float32", "aliases": ["twin"]}

    # Not for a tenant admin; validation before anything starts.
    assert client.post("/admin/v1/models", headers=world["tenant_admin"], json=body).status_code == 403
    bad_path = client.post("/admin/v1/models", headers=admin, json={**body, "path": "/no/such/model.gguf"})
    assert bad_path.status_code == 422 and bad_path.json()["error"]["param"] == "path"
    taken = client.post("/admin/v1/models", headers=admin, json={**body, "name": "smollm2-135m-instruct"})
    assert taken.status_code == 409
    assert client.post("/admin/v1/models", headers=admin, json={**body, "backend": "no-such"}).status_code == 422

    started = client.post("/admin/v1/models", headers=admin, json=body)
    assert started.status_code == 202, started.text
    assert started.json()["status"] == "loading"
    assert client.post("/admin/v1/models", headers=admin, json=body).status_code == 409  # already loading
    loaded = wait_loaded(client, admin, "second")
    assert loaded["status"] == "ready", loaded
    assert loaded["source"] == "admin" and loaded["aliases"] == ["twin"] and loaded["default"] is False

    # Served at once, by name and alias, to callers allowed every model.
    ids = [m["id"] for m in client.get("/v1/models", headers=admin).json()["data"]]
    assert ids.count("second") == 1
    chat = {"model": "twin", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answer = client.post("/v1/chat/completions", headers=admin, json=chat)
    assert answer.status_code == 200 and answer.json()["model"] == "second"

    # Default; recorded in the store.
    assert client.post("/admin/v1/models/second/default", headers=admin).json()["default"] is True
    record = store.get_served_model_by_name("second")
    assert record.is_default and record.aliases == ("twin",) and record.dtype == "float32"
    listed = {m["id"]: m for m in client.get("/admin/v1/models", headers=admin).json()["data"]}
    assert listed["second"]["default"] and not listed["smollm2-135m-instruct"]["default"]

    # A restart serves the same set: restore() on a fresh manager loads it from the store.
    settings = Settings(data_dir=world["data_dir"], engine={"kv_cache_bytes": 32 * 1024 * 1024})
    manager = ModelManager()
    try:
        assert ModelAdmin(manager, store, settings, configured=set()).restore() == []
        assert [m.name for m in manager] == ["second"] and manager.default_name == "second"
    finally:
        manager.shutdown()

    # The configured model cannot be unloaded here; the admin-loaded one can, and is forgotten.
    assert client.delete("/admin/v1/models/smollm2-135m-instruct", headers=admin).status_code == 409
    assert client.delete("/admin/v1/models/second", headers=admin).status_code == 204
    assert client.get("/admin/v1/models/second", headers=admin).status_code == 404
    assert "second" not in [m["id"] for m in client.get("/v1/models", headers=admin).json()["data"]]
    assert store.list_served_models() == []
    assert client.post("/v1/chat/completions", headers=admin, json=chat).status_code == 404


def test_a_failed_load_is_reported_not_raised(world: dict[str, Any], tmp_path: Path) -> None:
    client, admin = world["client"], world["admin"]
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)  # the right name and magic, nothing loadable
    started = client.post("/admin/v1/models", headers=admin, json={"name": "broken", "path": str(broken)})
    assert started.status_code == 202
    status = wait_loaded(client, admin, "broken")
    assert status["status"] == "failed" and status["error"]
    assert world["store"].list_served_models() == []
    assert client.delete("/admin/v1/models/broken", headers=admin).status_code == 204  # forget it
    assert client.get("/admin/v1/models/broken", headers=admin).status_code == 404


def test_pagination(world: dict[str, Any]) -> None:
    client, admin = world["client"], world["admin"]
    for i in range(7):
        assert client.post("/admin/v1/tenants", headers=admin, json={"name": f"page-{i}"}).status_code == 201
    seen: list[str] = []
    after = None
    pages = 0
    while True:
        url = "/admin/v1/tenants?limit=3" + (f"&after={after}" if after else "")
        page = client.get(url, headers=admin).json()
        assert len(page["data"]) <= 3
        seen += [t["name"] for t in page["data"]]
        pages += 1
        after = page["next_cursor"]
        if after is None:
            break
    assert pages >= 3 and len(seen) == len(set(seen))
    assert {f"page-{i}" for i in range(7)} <= set(seen)
    for bad in ("0", "201", "x", "-1"):
        response = client.get(f"/admin/v1/tenants?limit={bad}", headers=admin)
        assert response.status_code == 422 and response.json()["error"]["param"] == "limit"
    assert client.get("/admin/v1/tenants?after=garbage", headers=admin).status_code in (400, 422)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"name": "Bad Name"}, "name"),
        ({"name": "ok", "unexpected": 1}, "unexpected"),
        ({"name": 5}, "name"),
        ({"name": "ok", "allowed_models": "all"}, "allowed_models"),
        ({"name": "ok", "allowed_models": ["no-such-model"]}, "allowed_models"),
    ],
)
def test_tenant_body_validation(world: dict[str, Any], body: dict[str, Any], param: str) -> None:
    response = world["client"].post("/admin/v1/tenants", headers=world["admin"], json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_key_body_validation_and_conflicts(world: dict[str, Any]) -> None:
    client, admin, tenant = world["client"], world["admin"], world["tenant"]
    url = f"/admin/v1/tenants/{tenant.id}/keys"
    assert client.post(url, headers=admin, json={"name": "x", "role": "superuser"}).status_code == 422
    assert client.post(url, headers=admin, json={"name": "x", "role": "member", "expires_in_seconds": 1}).status_code == 422
    assert client.post(url, headers=admin, content=b"{not json", ).status_code == 400
    assert client.post("/admin/v1/tenants", headers=admin, json={"name": "acme"}).status_code == 409


def test_oidc_provider_secret_is_write_only(world: dict[str, Any]) -> None:
    client, admin = world["client"], world["admin"]
    created = client.post(
        "/admin/v1/oidc-providers",
        headers=admin,
        json={"name": "corp", "issuer": "https://login.example.com", "audience": "inferflux", "client_secret": "s3cr3t"},
    )
    assert created.status_code == 201, created.text
    provider = created.json()
    assert "client_secret" not in provider and provider["has_client_secret"] is True
    fetched = client.get(f"/admin/v1/oidc-providers/{provider['id']}", headers=admin)
    assert "s3cr3t" not in fetched.text
    bad = client.patch(f"/admin/v1/oidc-providers/{provider['id']}", headers=admin, json={"algorithms": ["HS256"]})
    assert bad.status_code == 422
    bad = client.post(
        "/admin/v1/oidc-providers",
        headers=admin,
        json={"name": "plain", "issuer": "http://idp.example.com", "audience": "x"},  # not https, not loopback
    )
    assert bad.status_code == 422
    assert client.delete(f"/admin/v1/oidc-providers/{provider['id']}", headers=admin).status_code == 204
    assert client.get(f"/admin/v1/oidc-providers/{provider['id']}", headers=admin).status_code == 404


def test_openapi_documents_every_route(world: dict[str, Any]) -> None:
    client = world["client"]
    assert client.get("/openapi.json").status_code == 401
    doc = client.get("/openapi.json", headers=world["tenant_admin"]).json()
    assert doc["openapi"].startswith("3.")
    for route in world["app"].routes:
        assert isinstance(route, Route)
        for method in route.methods - {"HEAD"}:
            operation = doc["paths"][route.path][method.lower()]
            public = route.path in ("/livez", "/readyz", "/metrics")
            assert (operation["security"] == []) is public, route.path
            if not public:
                assert operation["x-required-scope"] in {"read", "generate", "admin:tenant", "admin:platform"}
            assert operation["summary"] and operation["responses"]
    assert doc["paths"]["/admin/v1/tenants"]["post"]["requestBody"]
    assert "TenantCreate" in doc["components"]["schemas"]
    assert "ChatCompletionRequest" in doc["components"]["schemas"]
