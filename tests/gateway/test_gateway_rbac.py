"""Every route × every role: authentication first, then the route's scope.

The expected scope of each route is written out here by hand, not read from
the decorator under test, so a route that asks for the wrong scope fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.authz import SCOPE_ATTR
from policy.rbac import ROLE_SCOPES, Role, Scope
from policy.store import PolicyStore, StoreSettings

PUBLIC = {("GET", "/livez"), ("GET", "/readyz"), ("GET", "/metrics")}

R, G, T, P = Scope.READ, Scope.GENERATE, Scope.ADMIN_TENANT, Scope.ADMIN_PLATFORM
T_ = "/admin/v1/tenants/{tenant_id}"
EXPECTED: dict[tuple[str, str], Scope] = {
    ("POST", "/v1/chat/completions"): G,
    ("POST", "/v1/completions"): G,
    ("GET", "/v1/models"): R,
    ("GET", "/v1/models/{model_id:path}"): R,
    ("GET", "/openapi.json"): R,
    ("GET", "/admin/v1/whoami"): R,
    ("GET", "/admin/v1/tenants"): P,
    ("POST", "/admin/v1/tenants"): P,
    ("GET", T_): T,
    ("PATCH", T_): P,
    ("DELETE", T_): P,
    ("GET", T_ + "/models"): T,
    ("PUT", T_ + "/models"): P,
    ("GET", T_ + "/keys"): T,
    ("POST", T_ + "/keys"): T,
    ("GET", T_ + "/keys/{key_id}"): T,
    ("POST", T_ + "/keys/{key_id}/revoke"): T,
    ("POST", T_ + "/keys/{key_id}/rotate"): T,
    ("GET", T_ + "/role-bindings"): T,
    ("POST", T_ + "/role-bindings"): T,
    ("GET", T_ + "/role-bindings/{binding_id}"): T,
    ("DELETE", T_ + "/role-bindings/{binding_id}"): T,
    ("GET", T_ + "/audit"): T,
    ("GET", "/admin/v1/oidc-providers"): P,
    ("POST", "/admin/v1/oidc-providers"): P,
    ("GET", "/admin/v1/oidc-providers/{provider_id}"): P,
    ("PATCH", "/admin/v1/oidc-providers/{provider_id}"): P,
    ("DELETE", "/admin/v1/oidc-providers/{provider_id}"): P,
    ("GET", "/admin/v1/models"): P,
    ("POST", "/admin/v1/models"): P,
    ("GET", "/admin/v1/models/{name}"): P,
    ("DELETE", "/admin/v1/models/{name}"): P,
    ("POST", "/admin/v1/models/{name}/default"): P,
}


def app_routes(app: Any) -> Iterator[tuple[str, str, Any]]:
    for route in app.routes:
        assert isinstance(route, Route)
        for method in sorted(route.methods or ()):
            if method != "HEAD":
                yield method, route.path, route.endpoint


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A fresh store with a tenant, one key per role, and an app over it."""
    data_dir: Path = tmp_path_factory.mktemp("rbac")
    store = PolicyStore.open(StoreSettings(), data_dir)
    admin_key = store.ensure_bootstrap_admin()
    tenant = store.create_tenant("acme")
    keys = {Role.PLATFORM_ADMIN.value: admin_key}
    for role in ("tenant-admin", "member", "viewer"):
        keys[role] = store.create_api_key(tenant.id, role, role)[1]
    other = store.create_tenant("globex")
    app = make_app(store)
    with TestClient(app) as client:
        yield {"store": store, "app": app, "client": client, "keys": keys, "tenant": tenant, "other": other}
    store.close()


def test_the_table_covers_every_route(world: dict[str, Any]) -> None:
    routes = {(m, p) for m, p, _ in app_routes(world["app"])}
    assert routes - PUBLIC == set(EXPECTED), "a route was added or removed: update EXPECTED (and its scope)"


def test_every_protected_endpoint_declares_its_scope(world: dict[str, Any]) -> None:
    # Default deny: the decorator is what enforces the scope, so it must be on every route.
    for method, path, endpoint in app_routes(world["app"]):
        if (method, path) in PUBLIC:
            continue
        assert getattr(endpoint, SCOPE_ATTR, None) == EXPECTED[(method, path)], (method, path)


def concrete(path: str, world: dict[str, Any]) -> str:
    return (
        path.replace("{tenant_id}", world["tenant"].id)
        .replace("{key_id}", "key_doesnotexist00")
        .replace("{binding_id}", "rb_doesnotexist000")
        .replace("{provider_id}", "idp_doesnotexist00")
        .replace("{model_id:path}", "smollm2-135m-instruct")
        .replace("{name}", "no-such-model")
    )


BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/chat/completions"): {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    },
    ("POST", "/v1/completions"): {"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 1},
}


@pytest.mark.parametrize("method,path", sorted(EXPECTED))
def test_no_credentials_is_401(world: dict[str, Any], method: str, path: str) -> None:
    response = world["client"].request(method, concrete(path, world), json=BODIES.get((method, path)))
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error" and error["code"] == "missing_credentials"


@pytest.mark.parametrize("method,path", sorted(PUBLIC))
def test_public_routes_need_no_credentials(world: dict[str, Any], method: str, path: str) -> None:
    assert world["client"].request(method, path).status_code == 200


@pytest.mark.parametrize("role", [r.value for r in Role])
@pytest.mark.parametrize("method,path", sorted(EXPECTED))
def test_scope_is_enforced_for_each_role(world: dict[str, Any], role: str, method: str, path: str) -> None:
    allowed = EXPECTED[(method, path)] in ROLE_SCOPES[Role(role)]
    headers = {"authorization": f"Bearer {world['keys'][role]}"}
    url = concrete(path, world)
    if (method, path) == ("DELETE", T_):  # the test's own tenant must survive: delete one that never was
        url = path.replace("{tenant_id}", "ten_doesnotexist00")
    response = world["client"].request(method, url, json=BODIES.get((method, path), {}), headers=headers)
    assert response.status_code < 500, response.text
    if allowed:
        # It got past authorisation: a success, a validation error or a 404 for the made-up ids.
        assert response.status_code not in (401, 403), response.text
    else:
        assert response.status_code == 403, response.text
        assert response.json()["error"]["code"] == "insufficient_scope"


def test_role_scopes_are_nested_as_documented() -> None:
    assert ROLE_SCOPES[Role.VIEWER] == {R}
    assert ROLE_SCOPES[Role.MEMBER] == {R, G}
    assert ROLE_SCOPES[Role.TENANT_ADMIN] == {R, G, T}
    assert ROLE_SCOPES[Role.PLATFORM_ADMIN] == {R, G, T, P}


@pytest.mark.parametrize("header", ["authorization", "x-api-key"])
def test_key_is_accepted_as_bearer_or_x_api_key(world: dict[str, Any], header: str) -> None:
    key = world["keys"]["member"]
    value = f"Bearer {key}" if header == "authorization" else key
    response = world["client"].get("/admin/v1/whoami", headers={header: value})
    assert response.status_code == 200
    assert response.json()["roles"] == ["member"] and response.json()["tenant"] == "acme"


def flip(key: str) -> str:
    last = key[-1]
    return key[:-1] + ("A" if last != "A" else "B")


@pytest.mark.parametrize(
    "headers,code",
    [
        ({"authorization": "Basic dXNlcjpwYXNz"}, "invalid_authorization_header"),
        ({"authorization": "Bearer"}, "invalid_authorization_header"),
        ({"authorization": "Bearer ifx_aaaaaaaaaaaa_" + "a" * 43}, "invalid_api_key"),
        ({"x-api-key": "ifx_short"}, "invalid_api_key"),
        ({"x-api-key": "not-a-key-or-token"}, "invalid_credentials"),
        ({"authorization": "Bearer a.b.c"}, None),  # a JWT-shaped string: rejected by the verifier
    ],
)
def test_bad_credentials_are_401(world: dict[str, Any], headers: dict[str, str], code: str | None) -> None:
    response = world["client"].get("/v1/models", headers=headers)
    assert response.status_code == 401, response.text
    if code is not None:
        assert response.json()["error"]["code"] == code


def test_a_key_with_one_changed_character_is_refused(world: dict[str, Any]) -> None:
    key = world["keys"]["member"]
    assert world["client"].get("/v1/models", headers={"x-api-key": key}).status_code == 200
    response = world["client"].get("/v1/models", headers={"x-api-key": flip(key)})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_revoked_expired_and_rotated_keys(world: dict[str, Any]) -> None:
    store, client, tenant = world["store"], world["client"], world["tenant"]
    admin = {"authorization": f"Bearer {world['keys']['platform-admin']}"}

    def works(key: str) -> bool:
        status = client.get("/admin/v1/whoami", headers={"x-api-key": key}).status_code
        assert status in (200, 401)
        return status == 200

    record, key = store.create_api_key(tenant.id, "to-revoke", "member")
    assert works(key)
    revoked = client.post(f"/admin/v1/tenants/{tenant.id}/keys/{record.id}/revoke", headers=admin)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    assert not works(key)

    # Expiry: rotation sets the old key's expiry to the end of its grace period (now, for grace 0).
    record, key = store.create_api_key(tenant.id, "to-rotate", "member")
    assert works(key)
    body = client.post(
        f"/admin/v1/tenants/{tenant.id}/keys/{record.id}/rotate", headers=admin, json={"grace_seconds": 3600}
    ).json()
    assert works(key) and works(body["key"])  # both during the grace period
    again = client.post(
        f"/admin/v1/tenants/{tenant.id}/keys/{body['id']}/rotate", headers=admin, json={"grace_seconds": 0}
    ).json()
    assert not works(body["key"]) and works(again["key"])
    assert works(key)  # the first key's grace period is its own

    listed = client.get(f"/admin/v1/tenants/{tenant.id}/keys?limit=200", headers=admin).json()["data"]
    assert all("key" not in k and "key_hash" not in k for k in listed)
    assert {k["prefix"] for k in listed} >= {key.split("_")[1], again["key"].split("_")[1]}
