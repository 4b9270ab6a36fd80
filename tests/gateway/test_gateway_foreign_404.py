"""404, never 403, for everything of another tenant and for platform-only routes (issue 18).

The table is every admin route of the app (read from its routes, so a route added later is
covered or fails here), each sent by acme's tenant admin at globex: globex's id in the path,
the ids of globex's own objects, globex named in the query or the body, or (platform-only
routes that name no tenant) the route itself. Each answer must be 404 ``not_found``, exactly
the answer for an id (or a route) that does not exist, and change nothing. The global lists
that are simply filtered to the caller's tenant answer 200 without a trace of globex.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from admin_seed import Seeded, seed_store
from http_helpers import assert_same_answer, error_of

PREFIX = "/admin/v1"
GUARD_SPEC = {"blocklist": [{"id": "never", "literal": "zzneverzz"}]}


@dataclass
class World(Seeded):
    client: TestClient
    app: Any
    params: dict[str, str]  # path parameter -> globex's object (policy_id: see policy_ids)
    policy_ids: dict[str, str]  # route prefix -> the policy_id for routes under it


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    seeded = seed_store(tmp_path_factory.mktemp("foreign-404"))
    store, globex = seeded.store, seeded.globex
    key, _ = store.create_api_key(globex.id, "theirs", "member")
    binding = store.create_role_binding(globex.id, provider_id=seeded.provider.id, kind="group", subject="g",
                                        role="member")  # fmt: skip
    provider = store.create_oidc_provider("theirs", "https://globex-sso.example.com", "inferflux", tenant_id=globex.id)
    limit = store.create_policy(globex.id, "rate_limit", "theirs", {"requests_per_minute": 10**9})
    guardrail = store.create_policy(globex.id, "guardrail", "theirs", GUARD_SPEC)
    global_limit = store.create_policy(None, "rate_limit", "everyone", {"requests_per_minute": 10**9})
    credential = store.create_credential(None, "upstream", "sk-platform-only")  # the platform's: no tenant has one
    params = {"tenant_id": globex.id, "key_id": key.id, "binding_id": binding.id, "provider_id": provider.id,
              "name": DEFAULT_MODEL_NAME, "model": DEFAULT_MODEL_NAME, "credential_id": credential.id}  # fmt: skip
    policy_ids = {f"{PREFIX}/tenants/": limit.id, f"{PREFIX}/policies/": global_limit.id,
                  f"{PREFIX}/guardrails/": guardrail.id}  # fmt: skip
    app = make_app(store)
    with TestClient(app) as client:
        yield World(**seeded.seeded(), client=client, app=app, params=params, policy_ids=policy_ids)
    store.close()


def admin_routes(app: Any) -> list[tuple[str, str]]:
    return sorted(
        (method, route.path)
        for route in app.routes
        if isinstance(route, Route) and route.path.startswith(PREFIX)
        for method in route.methods or ()
        if method != "HEAD"
    )


# Global routes whose answer is the caller's own tenant's, filtered: 200, with nothing of globex.
FILTERED = {
    ("GET", f"{PREFIX}/whoami"),
    ("GET", f"{PREFIX}/status"),
    ("GET", f"{PREFIX}/oidc-providers"),
    ("GET", f"{PREFIX}/guardrails"),
    ("GET", f"{PREFIX}/audit"),
    ("GET", f"{PREFIX}/usage"),
}
# Global routes that take the tenant in the query (or, to create, in the body).
TENANT_IN_QUERY = {f"{PREFIX}/audit", f"{PREFIX}/audit/stream", f"{PREFIX}/guardrails",
                   f"{PREFIX}/guardrails/{{policy_id}}", f"{PREFIX}/whoami", f"{PREFIX}/status",
                   f"{PREFIX}/oidc-providers",
                   f"{PREFIX}/usage"}  # fmt: skip
BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", f"{PREFIX}/guardrails"): {"name": "mine", "spec": GUARD_SPEC},
    ("POST", f"{PREFIX}/oidc-providers"): {"name": "mine", "issuer": "https://mine.example.com", "audience": "a"},
}


def missing_like(real: str) -> str:
    kind, sep, rest = real.partition("_")
    return f"{kind}_{'z' * len(rest)}" if sep else "z" * len(real)


def foreign_request(world: World, method: str, template: str) -> tuple[str, Any, dict[str, str]]:
    """The request naming globex on this route, its body, and {globex's ids in it: ids that name nothing}."""
    url, ids = template, {}
    for name in Route(template, lambda r: None).param_convertors:
        if name == "policy_id":
            value = next(v for prefix, v in world.policy_ids.items() if template.startswith(prefix))
        else:
            assert name in world.params, f"path parameter {name!r} of {method} {template}: add it to the table"
            value = world.params[name]
        url = url.replace(f"{{{name}}}", value)
        if name != "name":
            ids[value] = missing_like(value)
    body = dict(BODIES.get((method, template), {"enabled": False}))
    if "{tenant_id}" not in template and template in TENANT_IN_QUERY:
        if method == "POST":
            body["tenant_id"] = world.globex.id
        else:
            url += f"?tenant_id={world.globex.id}"
        ids[world.globex.id] = missing_like(world.globex.id)
    return url, (body if method in ("POST", "PATCH", "PUT") else None), ids


# Global routes to objects a tenant owns: another tenant's is answered like a missing one.
TENANT_OBJECTS = {f"{PREFIX}/oidc-providers/{{provider_id}}"}


def platform_only(template: str) -> bool:
    return "{tenant_id}" not in template and template not in TENANT_IN_QUERY | TENANT_OBJECTS


def send(world: World, method: str, url: str, body: Any) -> Any:
    return world.client.request(method, url, json=body, headers=world.acme_admin)


def declared_routes() -> list[tuple[str, str]]:
    """The admin routes as the admin package declares them, for parametrizing before any app exists."""
    from inferflux.gateway.routes import admin

    return sorted((m, r.path) for r in admin.routes() if isinstance(r, Route) for m in r.methods or () if m != "HEAD")


def test_the_table_is_every_admin_route_of_the_app(world: World) -> None:
    # A route added to the app but not declared where the table reads it would escape the table.
    assert admin_routes(world.app) == declared_routes()
    assert FILTERED <= set(declared_routes())


@pytest.mark.parametrize(("method", "template"), declared_routes())
def test_every_admin_route_answers_404_for_another_tenant(world: World, method: str, template: str) -> None:
    version = world.store.policy_version()
    url, body, ids = foreign_request(world, method, template)
    seen = send(world, method, url, body)
    assert seen.status_code == 404, (method, url, seen.text)
    assert error_of(seen)["code"] == "not_found", (method, url)
    if platform_only(template):
        # As if the route did not exist at all (a made-up route of the same length, so headers match too).
        segment = url.removeprefix(PREFIX + "/").split("/")[0].split("?")[0]
        nowhere = url.replace(f"{PREFIX}/{segment}", f"{PREFIX}/{'z' * len(segment)}", 1)
        absent = send(world, method, nowhere, body)
        assert_same_answer(seen, absent, {url.split("?")[0]: nowhere.split("?")[0]})
    else:
        missing_url, missing_body = url, body
        for real, missing in ids.items():
            missing_url = missing_url.replace(real, missing)
            if isinstance(missing_body, dict) and missing_body.get("tenant_id") == real:
                missing_body = {**missing_body, "tenant_id": missing}
        assert_same_answer(seen, send(world, method, missing_url, missing_body), ids)
    assert world.store.policy_version() == version, "a refused request changed something"
    assert world.store.get_tenant(world.globex.id).disabled is False


@pytest.mark.parametrize(("method", "path"), sorted(FILTERED))
def test_global_lists_are_filtered_to_the_callers_tenant(world: World, method: str, path: str) -> None:
    response = send(world, method, path, None)
    assert response.status_code == 200, response.text
    for value in (world.globex.id, *world.params.values(), *world.policy_ids.values()):
        if value != DEFAULT_MODEL_NAME:
            assert value not in response.text, (path, value)
