"""Acceptance tests for authentication, RBAC and tenancy (issue 3).

* every route × every role, against a scope table written out here by hand
  (not read from the decorator under test), with requests that succeed when
  the role holds the scope, so a wrong decorator or a wrong role table fails;
* the API key forms, and every way a key can be bad (malformed, unknown, one
  character off, revoked, expired, rotated away), each a 401 with its code;
* tenancy: another tenant's objects answer exactly like missing ones, and
  models outside an allow-list do not exist for the caller;
* privilege escalation: nobody hands out or removes more than it holds;
* the OpenAPI document lists every route, method and required scope.

Each test module gets its own store, so nothing here depends on other tests.
Generation requests ask for one token of the real session model.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.testclient import TestClient, WebSocketDenialResponse

from inferflux.gateway.auth import CONSOLE_PREFIX, PUBLIC_PATHS, Authenticator
from inferflux.gateway.authz import SCOPE_ATTR
from inferflux.gateway.openapi import openapi_path
from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from inferflux.policy.errors import ValidationFailed
from inferflux.policy.rbac import ROLE_SCOPES, Scope
from inferflux.policy.store import PolicyStore, StoreSettings
from inferflux.policy.usage.cost import Price
from inferflux.policy.usage.store import UsageStore
from http_helpers import assert_same_answer, bearer, error_of

MODEL = DEFAULT_MODEL_NAME
ALIAS = "smollm2"
ROLES = ("platform-admin", "tenant-admin", "member", "viewer")

R, G, T, P = Scope.READ, Scope.GENERATE, Scope.ADMIN_TENANT, Scope.ADMIN_PLATFORM

# What each role may do, written out (policy.rbac must agree; see the test below).
ROLE_HAS: dict[str, set[Scope]] = {
    "platform-admin": {R, G, T, P},
    "tenant-admin": {R, G, T},
    "member": {R, G},
    "viewer": {R},
}

PUBLIC = {("GET", "/livez"), ("GET", "/readyz"), ("GET", "/metrics")}

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
RESPONSE = {"model": MODEL, "input": "hi", "max_output_tokens": 1}
MESSAGE = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
# Policies the table creates: limits nobody reaches, a rule nothing here says.
LIMIT_SPEC = {"requests_per_minute": 10**9}
LIMIT_BODY = {"kind": "rate_limit", "name": "made", "spec": LIMIT_SPEC}
GUARD_SPEC = {"blocklist": [{"id": "never", "literal": "zzneverzz"}]}


# -- the world: one store, two ordinary tenants, one key per role -------------------------


@dataclass
class World:
    store: PolicyStore
    app: Any
    client: TestClient
    keys: dict[str, str]  # role -> key; platform-admin in "platform", the others in acme
    acme: Any
    globex: Any
    provider: Any
    _n: int = field(default=0)

    def uid(self) -> str:
        self._n += 1
        return str(self._n)

    def tenant(self) -> Any:
        return self.store.create_tenant(f"scratch-{self.uid()}")

    def key(self, role: str = "member", tenant_id: str | None = None) -> Any:
        return self.store.create_api_key(tenant_id or self.acme.id, f"k{self.uid()}", role)[0]

    def binding(self, role: str = "member", tenant_id: str | None = None) -> Any:
        return self.store.create_role_binding(
            tenant_id or self.acme.id, provider_id=self.provider.id, kind="subject", subject=f"s{self.uid()}", role=role
        )

    def new_provider(self, tenant_id: str | None = None) -> Any:
        """A provider of acme (default), which its tenant admin may manage too."""
        n = self.uid()
        return self.store.create_oidc_provider(
            f"idp-{n}", f"https://idp-{n}.example.com", "inferflux", tenant_id=tenant_id or self.acme.id
        )

    def policy(self, tenant_id: str | None) -> Any:
        return self.store.create_policy(tenant_id, "rate_limit", f"p{self.uid()}", LIMIT_SPEC)

    def guardrail(self, tenant_id: str | None = None) -> Any:
        return self.store.create_policy(tenant_id or self.acme.id, "guardrail", f"g{self.uid()}", GUARD_SPEC)

    def price(self) -> str:
        model = f"priced-{self.uid()}"
        UsageStore(self.store.engine).set_price(model, Price(150_000, 600_000))
        return model

    def credential(self) -> Any:
        """A platform credential (what an upstream names)."""
        return self.store.create_credential(None, f"c{self.uid()}", "sk-test")


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    data_dir: Path = tmp_path_factory.mktemp("authz")
    store = PolicyStore.open(StoreSettings(), data_dir)
    admin_key = store.ensure_bootstrap_admin()
    assert admin_key is not None
    acme, globex = store.create_tenant("acme"), store.create_tenant("globex")
    keys = {"platform-admin": admin_key}
    for role in ("tenant-admin", "member", "viewer"):
        keys[role] = store.create_api_key(acme.id, role, role)[1]
    # Platform-owned, for both tenants and the platform tenant (bindings are made in all three).
    provider = store.create_oidc_provider(
        "corp", "https://login.example.com", "inferflux", tenant_ids=[acme.id, globex.id], allow_platform=True
    )
    app = make_app(store)
    with TestClient(app) as client:
        yield World(store, app, client, keys, acme, globex, provider)
    store.close()


# -- 1. every route × every role --------------------------------------------------------


@dataclass(frozen=True)
class Case:
    scope: Scope
    status: int  # the answer to a role that holds the scope
    # The concrete URL and JSON body; may create what the request acts on, so
    # that an allowed request succeeds rather than 404s on a made-up id.
    build: Callable[[World], tuple[str, Any]]


PRICE_BODY = {"prompt_usd_per_million": "0.15", "completion_usd_per_million": 1}
TEN = "/admin/v1/tenants/{tenant_id}"
POL = "/admin/v1/policies"
GRD = "/admin/v1/guardrails"
CRD = "/admin/v1/credentials"

ROUTES: dict[tuple[str, str], Case] = {
    ("POST", "/v1/chat/completions"): Case(G, 200, lambda w: ("/v1/chat/completions", CHAT)),
    ("POST", "/v1/completions"): Case(G, 200, lambda w: ("/v1/completions", COMPLETION)),
    ("POST", "/v1/embeddings"): Case(G, 200, lambda w: ("/v1/embeddings", {"model": MODEL, "input": "hello"})),
    ("POST", "/v1/responses"): Case(G, 200, lambda w: ("/v1/responses", RESPONSE)),
    ("POST", "/v1/messages"): Case(G, 200, lambda w: ("/v1/messages", MESSAGE)),
    ("POST", "/v1/messages/count_tokens"): Case(G, 200, lambda w: ("/v1/messages/count_tokens", MESSAGE)),
    ("GET", "/v1/models"): Case(R, 200, lambda w: ("/v1/models", None)),
    ("GET", "/v1/models/{model_id:path}"): Case(R, 200, lambda w: (f"/v1/models/{MODEL}", None)),
    ("GET", "/openapi.json"): Case(R, 200, lambda w: ("/openapi.json", None)),
    ("GET", "/admin/v1/whoami"): Case(R, 200, lambda w: ("/admin/v1/whoami", None)),
    ("GET", "/admin/v1/status"): Case(R, 200, lambda w: ("/admin/v1/status", None)),
    ("GET", "/admin/v1/tenants"): Case(P, 200, lambda w: ("/admin/v1/tenants", None)),
    ("POST", "/admin/v1/tenants"): Case(P, 201, lambda w: ("/admin/v1/tenants", {"name": f"new-{w.uid()}"})),
    ("GET", TEN): Case(T, 200, lambda w: (f"/admin/v1/tenants/{w.acme.id}", None)),
    ("PATCH", TEN): Case(P, 200, lambda w: (f"/admin/v1/tenants/{w.tenant().id}", {"display_name": "Renamed"})),
    ("DELETE", TEN): Case(P, 204, lambda w: (f"/admin/v1/tenants/{w.tenant().id}", None)),
    ("GET", TEN + "/models"): Case(T, 200, lambda w: (f"/admin/v1/tenants/{w.acme.id}/models", None)),
    ("PUT", TEN + "/models"): Case(
        P, 200, lambda w: (f"/admin/v1/tenants/{w.tenant().id}/models", {"allowed_models": [MODEL]})
    ),
    ("GET", TEN + "/keys"): Case(T, 200, lambda w: (f"/admin/v1/tenants/{w.acme.id}/keys", None)),
    ("POST", TEN + "/keys"): Case(
        T, 201, lambda w: (f"/admin/v1/tenants/{w.acme.id}/keys", {"name": "made", "role": "viewer"})
    ),
    ("GET", TEN + "/keys/{key_id}"): Case(T, 200, lambda w: (f"/admin/v1/tenants/{w.acme.id}/keys/{w.key().id}", None)),
    ("POST", TEN + "/keys/{key_id}/revoke"): Case(
        T, 200, lambda w: (f"/admin/v1/tenants/{w.acme.id}/keys/{w.key().id}/revoke", None)
    ),
    ("POST", TEN + "/keys/{key_id}/rotate"): Case(
        T, 201, lambda w: (f"/admin/v1/tenants/{w.acme.id}/keys/{w.key().id}/rotate", {"grace_seconds": 0})
    ),
    ("GET", TEN + "/role-bindings"): Case(T, 200, lambda w: (f"/admin/v1/tenants/{w.acme.id}/role-bindings", None)),
    ("POST", TEN + "/role-bindings"): Case(
        T,
        201,
        lambda w: (
            f"/admin/v1/tenants/{w.acme.id}/role-bindings",
            {"provider_id": w.provider.id, "kind": "group", "subject": f"g{w.uid()}", "role": "viewer"},
        ),
    ),
    ("GET", TEN + "/role-bindings/{binding_id}"): Case(
        T, 200, lambda w: (f"/admin/v1/tenants/{w.acme.id}/role-bindings/{w.binding().id}", None)
    ),
    ("DELETE", TEN + "/role-bindings/{binding_id}"): Case(
        T, 204, lambda w: (f"/admin/v1/tenants/{w.acme.id}/role-bindings/{w.binding().id}", None)
    ),
    ("GET", TEN + "/audit"): Case(T, 200, lambda w: (f"/admin/v1/tenants/{w.acme.id}/audit", None)),
    ("GET", "/admin/v1/audit"): Case(T, 200, lambda w: ("/admin/v1/audit", None)),
    # Bounded, so that the allowed request ends (an unbounded stream would wait for events forever).
    ("GET", "/admin/v1/audit/stream"): Case(T, 200, lambda w: ("/admin/v1/audit/stream?max_seconds=0.05", None)),
    # Usage is read like the audit log; the price table is the platform's.
    ("GET", "/admin/v1/usage"): Case(T, 200, lambda w: ("/admin/v1/usage?by=model", None)),
    ("GET", "/admin/v1/prices"): Case(P, 200, lambda w: ("/admin/v1/prices", None)),
    ("GET", "/admin/v1/prices/{model}"): Case(P, 200, lambda w: (f"/admin/v1/prices/{w.price()}", None)),
    ("PUT", "/admin/v1/prices/{model}"): Case(P, 201, lambda w: (f"/admin/v1/prices/m{w.uid()}", PRICE_BODY)),
    ("DELETE", "/admin/v1/prices/{model}"): Case(P, 204, lambda w: (f"/admin/v1/prices/{w.price()}", None)),
    # Reading a tenant's limits is the tenant admin's; writing them is the platform's.
    ("GET", TEN + "/policies"): Case(T, 200, lambda w: (f"/admin/v1/tenants/{w.acme.id}/policies", None)),
    ("POST", TEN + "/policies"): Case(P, 201, lambda w: (f"/admin/v1/tenants/{w.acme.id}/policies", LIMIT_BODY)),
    ("GET", TEN + "/policies/{policy_id}"): Case(
        T, 200, lambda w: (f"/admin/v1/tenants/{w.acme.id}/policies/{w.policy(w.acme.id).id}", None)
    ),
    ("PATCH", TEN + "/policies/{policy_id}"): Case(
        P, 200, lambda w: (f"/admin/v1/tenants/{w.acme.id}/policies/{w.policy(w.acme.id).id}", {"enabled": False})
    ),
    ("DELETE", TEN + "/policies/{policy_id}"): Case(
        P, 204, lambda w: (f"/admin/v1/tenants/{w.acme.id}/policies/{w.policy(w.acme.id).id}", None)
    ),
    ("GET", POL): Case(P, 200, lambda w: (POL, None)),
    ("POST", POL): Case(P, 201, lambda w: (POL, LIMIT_BODY)),
    ("GET", POL + "/{policy_id}"): Case(P, 200, lambda w: (f"{POL}/{w.policy(None).id}", None)),
    ("PATCH", POL + "/{policy_id}"): Case(P, 200, lambda w: (f"{POL}/{w.policy(None).id}", {"name": "renamed"})),
    ("DELETE", POL + "/{policy_id}"): Case(P, 204, lambda w: (f"{POL}/{w.policy(None).id}", None)),
    # Guardrails are the tenant admin's to write for its own tenant (they can only make it stricter).
    ("GET", GRD): Case(T, 200, lambda w: (GRD, None)),
    ("POST", GRD): Case(T, 201, lambda w: (GRD, {"name": "made", "spec": GUARD_SPEC})),
    ("GET", GRD + "/{policy_id}"): Case(
        T, 200, lambda w: (f"{GRD}/{w.guardrail().id}?tenant_id={w.acme.id}", None)
    ),
    ("PATCH", GRD + "/{policy_id}"): Case(
        T, 200, lambda w: (f"{GRD}/{w.guardrail().id}?tenant_id={w.acme.id}", {"enabled": False})
    ),
    ("DELETE", GRD + "/{policy_id}"): Case(
        T, 204, lambda w: (f"{GRD}/{w.guardrail().id}?tenant_id={w.acme.id}", None)
    ),
    # A tenant admin manages its own tenant's identity providers; a platform admin every one.
    ("GET", "/admin/v1/oidc-providers"): Case(T, 200, lambda w: ("/admin/v1/oidc-providers", None)),
    ("POST", "/admin/v1/oidc-providers"): Case(
        T,
        201,
        lambda w: (
            "/admin/v1/oidc-providers",
            {"name": f"made-{w.uid()}", "issuer": f"https://made-{w.uid()}.example.com", "audience": "inferflux"},
        ),
    ),
    ("GET", "/admin/v1/oidc-providers/{provider_id}"): Case(
        T, 200, lambda w: (f"/admin/v1/oidc-providers/{w.new_provider().id}", None)
    ),
    ("PATCH", "/admin/v1/oidc-providers/{provider_id}"): Case(
        T, 200, lambda w: (f"/admin/v1/oidc-providers/{w.new_provider().id}", {"leeway_seconds": 10})
    ),
    ("DELETE", "/admin/v1/oidc-providers/{provider_id}"): Case(
        T, 204, lambda w: (f"/admin/v1/oidc-providers/{w.new_provider().id}", None)
    ),
    ("GET", "/admin/v1/models"): Case(P, 200, lambda w: ("/admin/v1/models", None)),
    # Allowed but refused on its merits: a load of a path that is not a model (no load starts).
    ("POST", "/admin/v1/models"): Case(
        P, 422, lambda w: ("/admin/v1/models", {"name": "never", "path": "/nonexistent/model.gguf"})
    ),
    ("GET", "/admin/v1/models/{name}"): Case(P, 200, lambda w: (f"/admin/v1/models/{MODEL}", None)),
    # Allowed but refused on its merits: the configured model cannot be unloaded here.
    ("DELETE", "/admin/v1/models/{name}"): Case(P, 409, lambda w: (f"/admin/v1/models/{MODEL}", None)),
    ("POST", "/admin/v1/models/{name}/default"): Case(P, 200, lambda w: (f"/admin/v1/models/{MODEL}/default", None)),
    # Upstream credentials are the platform's: only platform admins define upstreams.
    ("GET", CRD): Case(P, 200, lambda w: (CRD, None)),
    ("POST", CRD): Case(P, 201, lambda w: (CRD, {"name": f"made-{w.uid()}", "secret": "sk-made"})),
    ("GET", CRD + "/{credential_id}"): Case(P, 200, lambda w: (f"{CRD}/{w.credential().id}", None)),
    ("POST", CRD + "/{credential_id}/rotate"): Case(
        P, 200, lambda w: (f"{CRD}/{w.credential().id}/rotate", {"secret": "sk-rotated"})
    ),
    ("DELETE", CRD + "/{credential_id}"): Case(P, 204, lambda w: (f"{CRD}/{w.credential().id}", None)),
}


def app_routes(app: Any) -> Iterator[tuple[str, str, Any]]:
    """(method, path template, endpoint) for every route and method of ``app``, HEAD included."""
    for route in app.routes:
        if isinstance(route, Mount) and route.path == CONSOLE_PREFIX:
            # The web console signs its users in itself and calls the routes below for them
            # (tests/gateway/test_console.py checks it answers as they do).
            continue
        if isinstance(route, WebSocketRoute):  # a handshake, not a method: WEBSOCKET_ROUTES below
            continue
        assert isinstance(route, Route), f"a route of another kind ({route!r}) is not covered by these tests"
        for method in sorted(route.methods or ()):
            yield method, route.path, route.endpoint


# The WebSocket routes, by the scope their handshake requires (each request on them is then its HTTP route's).
WEBSOCKET_ROUTES: dict[str, Scope] = {"/v1/websocket": G}


def test_websocket_routes_are_listed_with_their_scope(world: World) -> None:
    served = {r.path: r.endpoint for r in world.app.routes if isinstance(r, WebSocketRoute)}
    assert set(served) == set(WEBSOCKET_ROUTES), "a WebSocket route was added or removed: add it to WEBSOCKET_ROUTES"
    for path, endpoint in served.items():
        assert getattr(endpoint, SCOPE_ATTR, None) == WEBSOCKET_ROUTES[path], path


@pytest.mark.parametrize("role", [*ROLES, None])
@pytest.mark.parametrize("path", sorted(WEBSOCKET_ROUTES))
def test_each_role_gets_the_websocket_handshake_its_scope_allows(world: World, role: str | None, path: str) -> None:
    headers = bearer(world.keys[role]) if role else {}
    if role is not None and WEBSOCKET_ROUTES[path] in ROLE_HAS[role]:
        with world.client.websocket_connect(path, headers=headers) as ws:
            ws.send_json({"id": "x", "type": "cancel"})  # accepted: the session answers
            assert ws.receive_json()["error"]["code"] == "unknown_id"
        return
    with pytest.raises(WebSocketDenialResponse) as denied:
        with world.client.websocket_connect(path, headers=headers):
            pass
    assert denied.value.status_code == (401 if role is None else 403)
    expected = "missing_credentials" if role is None else "insufficient_scope"
    assert denied.value.json()["error"]["code"] == expected


def test_role_table_is_as_documented() -> None:
    assert {role.value: set(scopes) for role, scopes in ROLE_SCOPES.items()} == ROLE_HAS


def test_tables_cover_every_route_of_the_app(world: World) -> None:
    served = {(m, p) for m, p, _ in app_routes(world.app) if m != "HEAD"}
    assert served - PUBLIC == set(ROUTES), "a route was added or removed: add it (with its scope) to ROUTES"
    assert PUBLIC <= served
    assert {p for _, p in PUBLIC} == PUBLIC_PATHS


def test_every_non_public_endpoint_requires_the_expected_scope(world: World) -> None:
    # Default deny: the decorator is what enforces a scope, so a route without one is a failure.
    for method, path, endpoint in app_routes(world.app):
        if method == "HEAD" or (method, path) in PUBLIC:
            continue
        assert getattr(endpoint, SCOPE_ATTR, None) == ROUTES[(method, path)].scope, (method, path)


@pytest.mark.parametrize("method,path", sorted(ROUTES))
def test_no_credentials_is_401(world: World, method: str, path: str) -> None:
    url, body = ROUTES[(method, path)].build(world)
    before = world.store.policy_version()
    response = world.client.request(method, url, json=body)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = error_of(response)
    assert error["type"] == "authentication_error" and error["code"] == "missing_credentials"
    assert world.store.policy_version() == before


def test_head_and_unknown_routes_need_credentials_too(world: World) -> None:
    heads = sorted((m, p) for m, p, _ in app_routes(world.app) if m == "HEAD" and ("GET", p) not in PUBLIC)
    assert heads, "GET routes answer HEAD as well"
    for _, path in heads:
        url, _ = ROUTES[("GET", path)].build(world)
        response = world.client.request("HEAD", url)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer", path
    # Authentication comes before routing: nothing about the route table leaks without credentials.
    for method, url in [("GET", "/admin/v1/nothing-here"), ("DELETE", "/v1/models"), ("GET", "/metrics/"),
                        ("GET", "/livez/extra"), ("GET", "/admin/v1/tenants/")]:
        response = world.client.request(method, url)
        assert response.status_code == 401, (method, url, response.text)
        assert error_of(response)["code"] == "missing_credentials"
    # With credentials, the same requests are told the truth.
    assert world.client.get("/admin/v1/nothing-here", headers=bearer(world.keys["viewer"])).status_code == 404
    assert world.client.delete("/v1/models", headers=bearer(world.keys["viewer"])).status_code == 405


@pytest.mark.parametrize("method,path", sorted(PUBLIC))
@pytest.mark.parametrize("role", [None, *ROLES])
def test_public_routes_answer_everyone(world: World, method: str, path: str, role: str | None) -> None:
    headers = bearer(world.keys[role]) if role else {}
    assert world.client.request(method, path, headers=headers).status_code == 200


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("method,path", sorted(ROUTES))
def test_each_role_gets_exactly_its_scopes(world: World, role: str, method: str, path: str) -> None:
    case = ROUTES[(method, path)]
    url, body = case.build(world)
    before = world.store.policy_version()
    response = world.client.request(method, url, json=body, headers=bearer(world.keys[role]))
    if case.scope in ROLE_HAS[role]:
        assert response.status_code == case.status, (role, method, url, response.text)
    elif hidden_from_tenants(world, case.scope, url):
        # A platform-only route, or another tenant's: to a tenant's principal, as if it did not exist.
        assert response.status_code == 404, (role, method, url, response.text)
        assert error_of(response)["code"] == "not_found"
        assert world.store.policy_version() == before, "a refused request changed the policy"
    else:
        assert response.status_code == 403, (role, method, url, response.text)
        error = error_of(response)
        assert error["type"] == "permission_error" and error["code"] == "insufficient_scope"
        assert case.scope.value in error["message"]
        assert world.store.policy_version() == before, "a refused request changed the policy"


def hidden_from_tenants(world: World, scope: Scope, url: str) -> bool:
    """What answers 404 to acme's principals: another tenant's path, and platform-only routes off acme's own path."""
    named = url.split("/admin/v1/tenants/", 1)[1].split("/")[0].split("?")[0] if "/admin/v1/tenants/" in url else None
    if named is not None and named != world.acme.id:
        return True
    return scope is P and named is None


@pytest.mark.parametrize("role", ROLES)
def test_keys_belong_where_the_issue_says(world: World, role: str) -> None:
    me = world.client.get("/admin/v1/whoami", headers=bearer(world.keys[role])).json()
    assert me["roles"] == [role]
    assert me["tenant"] == ("platform" if role == "platform-admin" else "acme")
    assert set(me["scopes"]) == {s.value for s in ROLE_HAS[role]}


# -- 6. the OpenAPI document -------------------------------------------------------------


def test_openapi_lists_every_route_method_and_scope(world: World) -> None:
    client = world.client
    unauthenticated = client.get("/openapi.json")
    assert unauthenticated.status_code == 401 and error_of(unauthenticated)["code"] == "missing_credentials"
    doc = client.get("/openapi.json", headers=bearer(world.keys["viewer"])).json()
    documented = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    served = {(m, openapi_path(p)) for m, p, _ in app_routes(world.app) if m != "HEAD"}
    assert documented == served
    for (method, path), case in ROUTES.items():
        operation = doc["paths"][openapi_path(path)][method.lower()]
        assert operation["x-required-scope"] == case.scope.value, (method, path)
        assert operation["security"], (method, path)
        assert operation["summary"] and {"401", "403"} <= set(operation["responses"]), (method, path)
        for name in Route(path, lambda r: None).param_convertors:  # every path parameter is declared
            assert any(p["name"] == name and p["in"] == "path" for p in operation["parameters"]), (path, name)
    for method, path in PUBLIC:
        operation = doc["paths"][openapi_path(path)][method.lower()]
        assert operation["security"] == [] and "x-required-scope" not in operation


# -- 2. API key forms and bad keys ----------------------------------------------------------


@pytest.mark.parametrize(
    "make_headers",
    [
        lambda key: {"authorization": f"Bearer {key}"},
        lambda key: {"authorization": f"bearer {key}"},
        lambda key: {"authorization": f"Bearer   {key}  "},
        lambda key: {"x-api-key": key},
    ],
    ids=["bearer", "lower-case-scheme", "extra-spaces", "x-api-key"],
)
def test_key_forms_that_work(world: World, make_headers: Callable[[str], dict[str, str]]) -> None:
    response = world.client.get("/admin/v1/whoami", headers=make_headers(world.keys["member"]))
    assert response.status_code == 200, response.text
    assert response.json()["roles"] == ["member"]


def change(key: str, index: int) -> str:
    """``key`` with the character at ``index`` replaced by another of the same alphabet."""
    old = key[index]
    alphabet = "234567" if old.isdigit() else "abc" if old.islower() else "ABC"  # within both key alphabets
    new = next(c for c in alphabet if c != old)
    return key[:index] + new + key[index + 1:]


def bad_credentials(world: World) -> list[tuple[str, dict[str, str], str]]:
    key = world.keys["member"]
    prefix_at, secret_at = key.index("_") + 1, key.rindex("_") + 1
    return [
        ("basic", {"authorization": "Basic dXNlcjpwYXNz"}, "invalid_authorization_header"),
        ("scheme-only", {"authorization": "Bearer"}, "invalid_authorization_header"),
        ("scheme-blank", {"authorization": "Bearer    "}, "invalid_authorization_header"),
        ("token-scheme", {"authorization": f"Token {key}"}, "invalid_authorization_header"),
        ("no-scheme", {"authorization": key}, "invalid_authorization_header"),
        ("empty-x-api-key", {"x-api-key": ""}, "missing_credentials"),
        ("unknown", {"authorization": "Bearer ifx_aaaaaaaaaaaa_" + "A" * 43}, "invalid_api_key"),
        ("secret-first-char", bearer(change(key, secret_at)), "invalid_api_key"),
        ("secret-middle-char", bearer(change(key, secret_at + 20)), "invalid_api_key"),
        ("secret-last-char", bearer(change(key, len(key) - 1)), "invalid_api_key"),
        ("prefix-char", bearer(change(key, prefix_at)), "invalid_api_key"),
        ("truncated", bearer(key[:-1]), "invalid_api_key"),
        ("one-more-char", bearer(key + "A"), "invalid_api_key"),
        ("secret-other-case", bearer(key[:secret_at] + key[secret_at:].swapcase()), "invalid_api_key"),
        ("not-a-key", {"x-api-key": "sk-not-ours"}, "invalid_credentials"),
        ("jwt-shaped", bearer("a.b.c"), "malformed_token"),
    ]


def test_bad_credentials_are_401_with_a_clear_code(world: World) -> None:
    for name, headers, code in bad_credentials(world):
        for url in ("/v1/models", "/admin/v1/whoami"):
            response = world.client.get(url, headers=headers)
            assert response.status_code == 401, (name, response.text)
            assert response.headers["www-authenticate"] == "Bearer", name
            error = error_of(response)
            assert error["type"] == "authentication_error" and error["code"] == code, (name, error)
    # The good key they were made from still works (no refusal was cached against it).
    assert world.client.get("/v1/models", headers=bearer(world.keys["member"])).status_code == 200


def test_a_revoked_key_is_401_at_once(world: World) -> None:
    record, key = world.store.create_api_key(world.acme.id, "short-lived", "member")
    assert world.client.get("/v1/models", headers={"x-api-key": key}).status_code == 200  # now cached
    revoked = world.client.post(
        f"/admin/v1/tenants/{world.acme.id}/keys/{record.id}/revoke", headers=bearer(world.keys["tenant-admin"])
    )
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    response = world.client.get("/v1/models", headers={"x-api-key": key})
    assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
    # Revoking again changes nothing and is not an error.
    again = world.client.post(
        f"/admin/v1/tenants/{world.acme.id}/keys/{record.id}/revoke", headers=bearer(world.keys["tenant-admin"])
    )
    assert again.status_code == 200 and again.json()["revoked_at"] == revoked.json()["revoked_at"]


@dataclass
class Clock:
    """Moves the store's and the authenticator's idea of now forward, without sleeping."""

    offset: float = 0.0

    def wall(self) -> float:
        return time.time() + self.offset


@pytest.fixture
def clocked(world: World, make_app: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, Clock]]:
    """A second app on the world's store whose clocks (the store's and the authenticator's) can be moved."""
    clock = Clock()
    real_now = world.store._now
    monkeypatch.setattr(world.store, "_now", lambda: real_now() + timedelta(seconds=clock.offset))
    authenticator = Authenticator(world.store, wall_clock=clock.wall)
    with TestClient(make_app(world.store, authenticator)) as client:
        yield client, clock


def test_an_expired_key_is_401_even_when_cached(world: World, clocked: tuple[TestClient, Clock]) -> None:
    client, clock = clocked
    record, key = world.store.create_api_key(
        world.acme.id, "expiring", "member", expires_at=datetime.now(UTC) + timedelta(seconds=120)
    )
    assert client.get("/v1/models", headers={"x-api-key": key}).status_code == 200  # cached from here on
    clock.offset = 121
    response = client.get("/v1/models", headers={"x-api-key": key})
    assert response.status_code == 401, response.text
    assert error_of(response)["code"] == "invalid_api_key"
    # The store refuses to make an already expired key at all.
    with pytest.raises(ValidationFailed, match="past"):
        world.store.create_api_key(world.acme.id, "dead", "member", expires_at=datetime.now(UTC) - timedelta(seconds=1))


def test_a_key_created_with_expires_in_expires(world: World, clocked: tuple[TestClient, Clock]) -> None:
    client, clock = clocked
    created = client.post(
        f"/admin/v1/tenants/{world.acme.id}/keys",
        json={"name": "temp", "role": "viewer", "expires_in_seconds": 60},
        headers=bearer(world.keys["tenant-admin"]),
    )
    assert created.status_code == 201 and created.json()["expires_at"]
    key = created.json()["key"]
    assert client.get("/v1/models", headers=bearer(key)).status_code == 200
    clock.offset = 61
    assert client.get("/v1/models", headers=bearer(key)).status_code == 401


def test_a_rotated_key_expires_when_the_key_it_replaces_would_have(
    world: World, clocked: tuple[TestClient, Clock]
) -> None:
    # Rotation must not turn a key given for a while into one valid for ever.
    client, clock = clocked
    admin = bearer(world.keys["tenant-admin"])
    keys_url = f"/admin/v1/tenants/{world.acme.id}/keys"
    created = client.post(keys_url, json={"name": "temp", "role": "viewer", "expires_in_seconds": 900}, headers=admin)
    rotated = client.post(f"{keys_url}/{created.json()['id']}/rotate", json={"grace_seconds": 60}, headers=admin)
    assert rotated.status_code == 201, rotated.text
    assert rotated.json()["expires_at"] == created.json()["expires_at"]
    new = rotated.json()["key"]
    clock.offset = 899
    assert client.get("/v1/models", headers=bearer(new)).status_code == 200
    clock.offset = 901
    assert client.get("/v1/models", headers=bearer(new)).status_code == 401


def test_rotation_keeps_the_old_key_for_the_grace_period_only(world: World, clocked: tuple[TestClient, Clock]) -> None:
    client, clock = clocked
    admin = bearer(world.keys["tenant-admin"])
    keys_url = f"/admin/v1/tenants/{world.acme.id}/keys"
    record, old = world.store.create_api_key(world.acme.id, "rotating", "member")

    def status(key: str) -> int:
        code = client.get("/admin/v1/whoami", headers={"x-api-key": key}).status_code
        assert code in (200, 401)
        return code

    assert status(old) == 200
    rotated = client.post(f"{keys_url}/{record.id}/rotate", json={"grace_seconds": 600}, headers=admin)
    assert rotated.status_code == 201, rotated.text
    new = rotated.json()["key"]
    assert rotated.json()["replaces"] == record.id and new != old
    assert rotated.json()["name"] == "rotating" and rotated.json()["role"] == "member"
    assert status(old) == 200 and status(new) == 200  # during the grace period, both
    # Once rotated, a key cannot be rotated again (that would fork it).
    assert client.post(f"{keys_url}/{record.id}/rotate", json={}, headers=admin).status_code == 409
    clock.offset = 601
    assert status(old) == 401 and status(new) == 200  # after it, only the new one

    # Grace 0: the old key stops at once; a rotation with no body uses the default grace.
    again = client.post(f"{keys_url}/{rotated.json()['id']}/rotate", json={"grace_seconds": 0}, headers=admin)
    assert again.status_code == 201
    assert status(new) == 401 and status(again.json()["key"]) == 200
    bodiless = client.post(f"{keys_url}/{again.json()['id']}/rotate", headers=admin)
    assert bodiless.status_code == 201
    assert status(again.json()["key"]) == 200 and status(bodiless.json()["key"]) == 200

    # A revoked key cannot be rotated back to life.
    revoked, _ = world.store.create_api_key(world.acme.id, "gone", "member")
    world.store.revoke_api_key(world.acme.id, revoked.id)
    assert client.post(f"{keys_url}/{revoked.id}/rotate", json={}, headers=admin).status_code == 409


# -- 3. tenancy: another tenant's objects do not exist for the caller ------------------------


def missing_like(real_id: str) -> str:
    """An id of the same kind and length as ``real_id`` that names nothing."""
    kind, _, rest = real_id.partition("_")
    return f"{kind}_{'z' * len(rest)}"


def tenant_requests(
    tenant_id: str, key_id: str, binding_id: str, provider_id: str, policy_id: str, guardrail_id: str
) -> list[tuple[str, str, Any, Scope]]:
    """Every admin request that names a tenant, each with a body that would be valid, and its scope."""
    t = f"/admin/v1/tenants/{tenant_id}"
    binding = {"provider_id": provider_id, "kind": "subject", "subject": "x", "role": "member"}
    return [
        ("GET", t, None, T),
        ("PATCH", t, {"display_name": "mine now"}, P),
        ("DELETE", t, None, P),
        ("GET", f"{t}/models", None, T),
        ("PUT", f"{t}/models", {"allowed_models": None}, P),
        ("GET", f"{t}/keys", None, T),
        ("POST", f"{t}/keys", {"name": "x", "role": "member"}, T),
        ("GET", f"{t}/keys/{key_id}", None, T),
        ("POST", f"{t}/keys/{key_id}/revoke", None, T),
        ("POST", f"{t}/keys/{key_id}/rotate", {"grace_seconds": 0}, T),
        ("GET", f"{t}/role-bindings", None, T),
        ("POST", f"{t}/role-bindings", binding, T),
        ("GET", f"{t}/role-bindings/{binding_id}", None, T),
        ("DELETE", f"{t}/role-bindings/{binding_id}", None, T),
        ("GET", f"{t}/audit", None, T),
        ("GET", f"/admin/v1/audit?tenant_id={tenant_id}", None, T),
        ("GET", f"/admin/v1/audit/stream?tenant_id={tenant_id}", None, T),
        ("GET", f"{t}/policies", None, T),
        ("POST", f"{t}/policies", LIMIT_BODY, P),
        ("GET", f"{t}/policies/{policy_id}", None, T),
        ("PATCH", f"{t}/policies/{policy_id}", {"enabled": False}, P),
        ("DELETE", f"{t}/policies/{policy_id}", None, P),
        ("GET", f"/admin/v1/guardrails?tenant_id={tenant_id}", None, T),
        ("POST", "/admin/v1/guardrails", {"tenant_id": tenant_id, "name": "mine", "spec": GUARD_SPEC}, T),
        ("GET", f"/admin/v1/guardrails/{guardrail_id}?tenant_id={tenant_id}", None, T),
        ("PATCH", f"/admin/v1/guardrails/{guardrail_id}?tenant_id={tenant_id}", {"enabled": False}, T),
        ("DELETE", f"/admin/v1/guardrails/{guardrail_id}?tenant_id={tenant_id}", None, T),
    ]


def test_another_tenants_objects_answer_like_missing_ones(world: World) -> None:
    store, client = world.store, world.client
    key = world.key(tenant_id=world.globex.id)
    binding = world.binding(tenant_id=world.globex.id)
    policy = world.policy(world.globex.id)
    guardrail = world.guardrail(world.globex.id)
    ids = {world.globex.id: missing_like(world.globex.id), key.id: missing_like(key.id),
           binding.id: missing_like(binding.id), policy.id: missing_like(policy.id),
           guardrail.id: missing_like(guardrail.id)}
    stats = world.app.state.audit_trail.spool.stats
    audited_before = stats.events + stats.pending  # written, fsynced or not yet
    version_before = store.policy_version()

    other = tenant_requests(world.globex.id, key.id, binding.id, world.provider.id, policy.id, guardrail.id)
    absent = tenant_requests(
        ids[world.globex.id], ids[key.id], ids[binding.id], world.provider.id, ids[policy.id], ids[guardrail.id]
    )
    for role in ("tenant-admin", "member", "viewer"):
        for (method, path, body, scope), (_, missing_path, missing_body, _) in zip(other, absent, strict=True):
            seen = client.request(method, path, json=body, headers=bearer(world.keys[role]))
            gone = client.request(method, missing_path, json=missing_body, headers=bearer(world.keys[role]))
            assert_same_answer(seen, gone, ids)
            error = error_of(seen)
            if scope not in ROLE_HAS[role] and isinstance(body, dict) and "tenant_id" in body:
                # Named only in a body it may not send at all: 403, for the real tenant and the missing one alike.
                assert seen.status_code == 403 and error["code"] == "insufficient_scope", (role, path, seen.text)
                continue
            # Named in the path or query, within its scope or not: 404, never 403, so it learns nothing.
            assert seen.status_code == 404, (role, method, path, seen.text)
            assert error["code"] == "not_found" and error["type"] == "invalid_request_error"

    # Nothing of globex was changed, and nothing was recorded as done: the events since are the refusals
    # (each refusal is audited, issue 18; repeats of one caller, route and reason are counted, not written).
    assert store.policy_version() == version_before
    spool = world.app.state.audit_trail.spool
    records = [json.loads(line) for path in spool.segment_paths() for line in path.read_bytes().splitlines()]
    # (An attempt, written before a change that a handler then refuses, records no change: see gateway.audit.
    # A count of repeated refusals may be flushed now for refusals made before this test: not ours either.)
    since = [r["event"] for r in records if r["seq"] >= audited_before and r["event"]["kind"] != "checkpoint"
             and r["event"].get("action") != "attempt" and not (r["event"].get("detail") or {}).get("aggregated")]
    assert since and all(e["decision"] == "deny" and e["status"] in (403, 404) for e in since), since
    assert store.get_policy(world.globex.id, policy.id).enabled is True
    assert store.get_policy(world.globex.id, guardrail.id).enabled is True
    assert store.get_api_key(world.globex.id, key.id).revoked_at is None
    assert store.get_role_binding(world.globex.id, binding.id).role == "member"
    assert store.get_tenant(world.globex.id).display_name is None


def test_own_tenant_path_with_another_tenants_ids_is_404(world: World) -> None:
    client, acme = world.client, world.acme
    key = world.key(tenant_id=world.globex.id)
    binding = world.binding(tenant_id=world.globex.id)
    ids = {key.id: missing_like(key.id), binding.id: missing_like(binding.id)}
    t = f"/admin/v1/tenants/{acme.id}"
    version_before = world.store.policy_version()
    for method, template, body in [
        ("GET", f"{t}/keys/{{k}}", None),
        ("POST", f"{t}/keys/{{k}}/revoke", None),
        ("POST", f"{t}/keys/{{k}}/rotate", {"grace_seconds": 0}),
        ("GET", f"{t}/role-bindings/{{b}}", None),
        ("DELETE", f"{t}/role-bindings/{{b}}", None),
    ]:
        seen = client.request(method, template.format(k=key.id, b=binding.id), json=body,
                              headers=bearer(world.keys["tenant-admin"]))
        gone = client.request(method, template.format(k=ids[key.id], b=ids[binding.id]), json=body,
                              headers=bearer(world.keys["tenant-admin"]))
        assert seen.status_code == 404, (method, template, seen.text)
        assert error_of(seen)["code"] == "not_found"
        assert_same_answer(seen, gone, ids)
    assert world.store.policy_version() == version_before
    assert world.store.get_api_key(world.globex.id, key.id).revoked_at is None
    # The platform admin, who may address every tenant, still cannot reach an object through the wrong tenant.
    wrong = client.get(f"{t}/keys/{key.id}", headers=bearer(world.keys["platform-admin"]))
    assert wrong.status_code == 404


def test_models_outside_the_allow_list_do_not_exist_for_the_caller(world: World) -> None:
    store, client = world.store, world.client
    closed = store.create_tenant("closed", allowed_models=[])
    opened = store.create_tenant("opened", allowed_models=[MODEL])
    _, closed_key = store.create_api_key(closed.id, "app", "member")
    _, narrowed_key = store.create_api_key(opened.id, "narrow", "member", allowed_models=[])
    _, open_key = store.create_api_key(opened.id, "app", "member")

    def refused(key: str, model: str) -> list[Any]:
        return [
            client.get(f"/v1/models/{model}", headers=bearer(key)),
            client.post("/v1/chat/completions", json={**CHAT, "model": model}, headers=bearer(key)),
            client.post("/v1/completions", json={**COMPLETION, "model": model}, headers=bearer(key)),
        ]

    for key in (closed_key, narrowed_key):  # the tenant's list, and a key's list narrowing an open tenant's
        assert client.get("/v1/models", headers=bearer(key)).json()["data"] == []
        for name in (MODEL, ALIAS):
            nonexistent = "x" * len(name)
            for seen, gone in zip(refused(key, name), refused(key, nonexistent), strict=True):
                assert seen.status_code == 404, seen.text
                error = error_of(seen)
                assert error["code"] == "model_not_found" and error["param"] in ("model", None)
                assert_same_answer(seen, gone, {name: nonexistent})

    # The control: the same requests work for a key the list allows.
    assert [m["id"] for m in client.get("/v1/models", headers=bearer(open_key)).json()["data"]] == [MODEL]
    assert all(r.status_code == 200 for r in refused(open_key, ALIAS))


def test_a_key_cannot_name_models_its_tenant_may_not_use(world: World) -> None:
    # Otherwise key creation would tell a tenant admin which models exist beyond its allow-list.
    closed = world.store.create_tenant("sealed", allowed_models=[])
    _, admin = world.store.create_api_key(closed.id, "admin", "tenant-admin")
    url = f"/admin/v1/tenants/{closed.id}/keys"
    hidden = world.client.post(
        url, json={"name": "k", "role": "member", "allowed_models": [MODEL]}, headers=bearer(admin)
    )
    nonexistent = "x" * len(MODEL)
    missing = world.client.post(
        url, json={"name": "k", "role": "member", "allowed_models": [nonexistent]}, headers=bearer(admin)
    )
    assert hidden.status_code == 422 and error_of(hidden)["param"] == "allowed_models"
    assert_same_answer(hidden, missing, {MODEL: nonexistent})
    # A model the tenant may use can be named.
    world.store.update_tenant(closed.id, allowed_models=[MODEL])
    ok = world.client.post(url, json={"name": "k", "role": "member", "allowed_models": [MODEL]}, headers=bearer(admin))
    assert ok.status_code == 201, ok.text


# -- 4. privilege escalation ----------------------------------------------------------------


def test_tenant_admin_cannot_escalate(world: World) -> None:
    client, acme, store = world.client, world.acme, world.store
    ta = bearer(world.keys["tenant-admin"])
    version = store.policy_version()

    # A platform-admin key or binding: 403 (its own scopes do not include admin:platform).
    for path, body in [
        (f"/admin/v1/tenants/{acme.id}/keys", {"name": "x", "role": "platform-admin"}),
        (f"/admin/v1/tenants/{acme.id}/role-bindings",
         {"provider_id": world.provider.id, "kind": "subject", "subject": "eve", "role": "platform-admin"}),
    ]:
        response = client.post(path, json=body, headers=ta)
        assert response.status_code == 403, response.text
        assert error_of(response)["code"] == "insufficient_scope"
    # Tenants are the platform's: not listed, created, renamed, disabled, deleted or re-scoped by a tenant
    # admin (its own tenant: 403; the platform-only routes: 404, as if they did not exist).
    mine = {"name": "mine", "issuer": "https://mine.example.com", "audience": "a"}
    for method, path, body, status in [
        ("GET", "/admin/v1/tenants", None, 404),
        ("POST", "/admin/v1/tenants", {"name": "mine"}, 404),
        ("PATCH", f"/admin/v1/tenants/{acme.id}", {"display_name": "x"}, 403),
        ("PATCH", f"/admin/v1/tenants/{acme.id}", {"disabled": True}, 403),
        ("DELETE", f"/admin/v1/tenants/{acme.id}", None, 403),
        ("PUT", f"/admin/v1/tenants/{acme.id}/models", {"allowed_models": None}, 403),
        # Its own identity providers, yes; platform-owned ones, or one mapping into other tenants, no.
        ("POST", "/admin/v1/oidc-providers", {**mine, "tenant_id": None}, 403),
        ("POST", "/admin/v1/oidc-providers", {**mine, "tenant_ids": [world.globex.id]}, 422),
        ("POST", "/admin/v1/oidc-providers", {**mine, "allow_platform": True}, 422),
        ("POST", "/admin/v1/oidc-providers", {**mine, "role_map": {"x": "platform-admin"}}, 422),
    ]:
        response = client.request(method, path, json=body, headers=ta)
        assert response.status_code == status, (method, path, response.text)
    assert store.policy_version() == version
    assert store.get_tenant(acme.id).disabled is False

    # What it may do: hand out roles up to its own.
    made = client.post(f"/admin/v1/tenants/{acme.id}/keys", json={"name": "peer", "role": "tenant-admin"}, headers=ta)
    assert made.status_code == 201


@pytest.mark.parametrize("role", ["member", "viewer"])
def test_members_and_viewers_cannot_manage_keys_or_bindings(world: World, role: str) -> None:
    client, acme = world.client, world.acme
    headers = bearer(world.keys[role])
    target = world.key()
    version = world.store.policy_version()
    for method, path, body in [
        ("POST", f"/admin/v1/tenants/{acme.id}/keys", {"name": "x", "role": "viewer"}),
        ("POST", f"/admin/v1/tenants/{acme.id}/keys", {"name": "x", "role": role}),
        ("GET", f"/admin/v1/tenants/{acme.id}/keys", None),
        ("POST", f"/admin/v1/tenants/{acme.id}/keys/{target.id}/revoke", None),
        ("POST", f"/admin/v1/tenants/{acme.id}/keys/{target.id}/rotate", None),
        ("POST", f"/admin/v1/tenants/{acme.id}/role-bindings",
         {"provider_id": world.provider.id, "kind": "subject", "subject": "me", "role": "viewer"}),
    ]:
        response = client.request(method, path, json=body, headers=headers)
        assert response.status_code == 403, (method, path, response.text)
        assert error_of(response)["code"] == "insufficient_scope"
    assert world.store.policy_version() == version


def test_platform_admin_roles_stay_in_the_platform_tenant(world: World) -> None:
    client, acme, store = world.client, world.acme, world.store
    pa = bearer(world.keys["platform-admin"])
    key = client.post(f"/admin/v1/tenants/{acme.id}/keys", json={"name": "x", "role": "platform-admin"}, headers=pa)
    assert key.status_code == 422 and error_of(key)["param"] == "role"
    binding = client.post(
        f"/admin/v1/tenants/{acme.id}/role-bindings",
        json={"provider_id": world.provider.id, "kind": "subject", "subject": "eve", "role": "platform-admin"},
        headers=pa,
    )
    assert binding.status_code == 422 and error_of(binding)["param"] == "role"
    # Even a row written to the store behind the API's back grants nothing outside the platform tenant.
    _, smuggled = store.create_api_key(acme.id, "smuggled", "platform-admin")
    response = client.get("/admin/v1/tenants", headers=bearer(smuggled))
    assert response.status_code == 401, response.text


def test_platform_tenant_cannot_be_deleted_or_disabled(world: World) -> None:
    client, store = world.client, world.store
    pa = bearer(world.keys["platform-admin"])
    platform = store.get_tenant_by_name("platform")
    deleted = client.delete(f"/admin/v1/tenants/{platform.id}", headers=pa)
    assert deleted.status_code == 409 and error_of(deleted)["code"] == "conflict"
    disabled = client.patch(f"/admin/v1/tenants/{platform.id}", json={"disabled": True}, headers=pa)
    assert disabled.status_code == 409 and error_of(disabled)["code"] == "conflict"
    assert store.get_tenant(platform.id).disabled is False
    assert client.get("/admin/v1/whoami", headers=pa).status_code == 200
    # Renaming it is allowed, and harmless.
    assert client.patch(f"/admin/v1/tenants/{platform.id}", json={"display_name": "Ops"}, headers=pa).status_code == 200


def test_a_tenant_admin_of_the_platform_tenant_cannot_touch_platform_admins(world: World) -> None:
    client, store = world.client, world.store
    platform = store.get_tenant_by_name("platform")
    _, key = store.create_api_key(platform.id, "ops", "tenant-admin")
    ops = bearer(key)
    admin_key = next(k for k in store.list_api_keys(platform.id, limit=200).items if k.role == "platform-admin")
    admin_binding = world.binding(role="platform-admin", tenant_id=platform.id)
    t = f"/admin/v1/tenants/{platform.id}"
    version = store.policy_version()
    for method, path, body in [
        ("POST", f"{t}/keys", {"name": "x", "role": "platform-admin"}),
        ("POST", f"{t}/keys/{admin_key.id}/revoke", None),
        ("POST", f"{t}/keys/{admin_key.id}/rotate", {"grace_seconds": 0}),
        ("DELETE", f"{t}/role-bindings/{admin_binding.id}", None),
        ("PATCH", t, {"disabled": True}),
    ]:
        response = client.request(method, path, json=body, headers=ops)
        assert response.status_code == 403, (method, path, response.text)
    assert store.policy_version() == version
    assert store.get_api_key(platform.id, admin_key.id).revoked_at is None
    assert client.get("/admin/v1/tenants", headers=bearer(world.keys["platform-admin"])).status_code == 200
    # It does administer its own tenant's ordinary keys.
    ordinary = world.key(tenant_id=platform.id)
    assert client.post(f"{t}/keys/{ordinary.id}/revoke", headers=ops).status_code == 200


def test_last_used_is_recorded_off_the_request_path(world: World) -> None:
    record, key = world.store.create_api_key(world.acme.id, f"tracked-{world.uid()}", "viewer")
    assert world.client.get("/v1/models", headers=bearer(key)).status_code == 200
    # Not written by the request itself: it waits for the periodic flush.
    assert world.store.get_api_key(world.acme.id, record.id).last_used_at is None
    world.client.portal.call(world.app.state.authenticator.flush_last_used)
    assert world.store.get_api_key(world.acme.id, record.id).last_used_at is not None
