"""Acceptance tests for the admin API's behaviour (issues 3 and 4).

Pagination, body validation (OpenAI-shaped 422s, never a 500), keys shown
once, admin events per tenant (on the audit trail, read from its index), disabled tenants, OIDC providers' write-only
secret, and the model admin's refusals. Loading a model for real (and
restoring it at start) is tested in ``test_gateway_admin_api.py``; nothing
here starts a load.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from inferflux.backends.models import default_model_path
from inferflux.gateway.routes.admin.guardrails import GuardrailCreate, GuardrailUpdate
from inferflux.gateway.routes.admin.idps import OidcProviderCreate, OidcProviderUpdate
from inferflux.gateway.routes.admin.keys import KeyCreate
from inferflux.gateway.routes.admin.models import ModelLoadRequest
from inferflux.gateway.routes.admin.policies import TrafficPolicyCreate, TrafficPolicyUpdate
from inferflux.gateway.routes.admin.role_bindings import RoleBindingCreate
from inferflux.gateway.routes.admin.tenants import ModelAllowList, TenantCreate, TenantUpdate
from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from inferflux.policy.audit import admin_event
from admin_seed import Seeded, seed_store
from audit_wait import eventually, wait_indexed
from http_helpers import bearer, error_of

MODEL = DEFAULT_MODEL_NAME

API_KEY_FIELDS = {
    "object", "id", "tenant_id", "prefix", "name", "role", "allowed_models", "created_at", "expires_at",
    "revoked_at", "last_used_at", "replaced_by", "created_by",
}


@dataclass
class World(Seeded):
    client: TestClient


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    seeded = seed_store(tmp_path_factory.mktemp("admin-behaviour"))
    with TestClient(make_app(seeded.store)) as client:
        yield World(**seeded.seeded(), client=client)
    seeded.store.close()


# -- pagination ------------------------------------------------------------------------------


def walk(client: TestClient, url: str, headers: dict[str, str], limit: int) -> list[dict[str, Any]]:
    """Every item of a list, page by page; checks the pages' shape on the way.

    A tenant's traffic policies are a filtered list (its guardrails are left
    out), so its pages may be short before the last; every other list's may not.
    """
    items: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"limit": limit}
        if after is not None:
            params["after"] = after
        response = client.get(url, params=params, headers=headers)
        assert response.status_code == 200, response.text
        page = response.json()
        assert page["object"] == "list" and set(page) == {"object", "data", "next_cursor"}
        items += page["data"]
        after = page["next_cursor"]
        if after is None:
            assert len(page["data"]) <= limit
            return items
        assert len(page["data"]) == limit or url.endswith("/policies")  # only the last page is short


def lists(world: World) -> list[tuple[str, dict[str, str]]]:
    t = f"/admin/v1/tenants/{world.acme.id}"
    return [
        ("/admin/v1/tenants", world.admin),
        (f"{t}/keys", world.acme_admin),
        (f"{t}/role-bindings", world.acme_admin),
        (f"{t}/audit", world.acme_admin),
        ("/admin/v1/audit", world.acme_admin),
        (f"{t}/policies", world.acme_admin),
        ("/admin/v1/guardrails", world.acme_admin),
        ("/admin/v1/oidc-providers", world.admin),
    ]


def test_every_list_pages_through_all_its_items(world: World) -> None:
    store, acme = world.store, world.acme
    recorded: set[str] = set()
    for i in range(7):
        store.create_tenant(f"page-{i}")
        store.create_api_key(acme.id, f"page-{i}", "viewer")
        store.create_role_binding(
            acme.id, provider_id=world.provider.id, kind="group", subject=f"page-{i}", role="viewer"
        )
        event = admin_event(principal="test", action="page.test", target_kind="tenant", tenant_id=acme.id)
        world.client.portal.call(world.client.app.state.audit_trail.record, event)
        recorded.add(event.id)
        store.create_policy(acme.id, "quota", f"page-{i}", {"period": "day", "tokens": 10**9})
        store.create_policy(acme.id, "guardrail", f"page-{i}", {"blocklist": [{"literal": f"zzpage{i}"}]})
        store.create_oidc_provider(f"page-{i}", f"https://page-{i}.example.com", "inferflux")
    # The audit lists are read from an index fed from the spool: wait until it has caught up.
    wait_indexed(world.client.app, lambda events: recorded <= {e["id"] for e in events}, acme.id)
    for url, headers in lists(world):
        whole = world.client.get(url, params={"limit": 200}, headers=headers).json()
        assert whole["next_cursor"] is None and len(whole["data"]) >= 7, url
        for limit in (1, 3, 7):
            items = walk(world.client, url, headers, limit)
            assert [i["id"] for i in items] == [i["id"] for i in whole["data"]], (url, limit)
        # The default page size is 50; the lists here are shorter.
        assert world.client.get(url, headers=headers).json()["data"] == whole["data"]


@pytest.mark.parametrize("limit", ["0", "201", "-1", "x", "", "1.5", "1e2", " 5", "²", "9" * 5000])
def test_limit_out_of_range_is_422(world: World, limit: str) -> None:
    for url, headers in lists(world):
        response = world.client.get(url, params={"limit": limit}, headers=headers)
        assert response.status_code == 422, (url, limit, response.text)
        error = error_of(response)
        assert error["param"] == "limit" and error["code"] == "invalid_value"
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "after",
    [
        "garbage",
        "!!!",
        base64.urlsafe_b64encode(b"[]").decode(),
        base64.urlsafe_b64encode(b'{"a": 1, "b": 2}').decode(),
        base64.urlsafe_b64encode(json.dumps(["2026-01-01T00:00:00", "x"]).encode()).decode(),  # no time zone
        base64.urlsafe_b64encode(b"\xff\xfe").decode(),
    ],
)
def test_a_cursor_that_is_not_one_is_422(world: World, after: str) -> None:
    for url, headers in lists(world):
        response = world.client.get(url, params={"after": after}, headers=headers)
        assert response.status_code == 422, (url, after, response.text)
        assert error_of(response)["param"] == "after"


# -- body validation -------------------------------------------------------------------------------


def body_cases(world: World) -> list[tuple[str, str, str, Any, str]]:
    """(what, method, url, body, param) requests whose bodies are well-formed JSON but wrong."""
    t = f"/admin/v1/tenants/{world.acme.id}"
    key = world.store.create_api_key(world.acme.id, "to-rotate", "member")[0]
    rb = {"provider_id": world.provider.id, "kind": "subject", "subject": "bob", "role": "member"}
    idp = {"name": "x", "issuer": "https://x.example.com", "audience": "a"}
    p = f"/admin/v1/oidc-providers/{world.provider.id}"
    return [
        ("tenant unknown field", "POST", "/admin/v1/tenants", {"name": "ok", "plan": "gold"}, "plan"),
        ("tenant wrong type", "POST", "/admin/v1/tenants", {"name": 5}, "name"),
        ("tenant bad name", "POST", "/admin/v1/tenants", {"name": "Not A Slug"}, "name"),
        ("tenant missing name", "POST", "/admin/v1/tenants", {}, "name"),
        ("tenant models not a list", "POST", "/admin/v1/tenants", {"name": "ok", "allowed_models": "all"},
         "allowed_models"),
        ("tenant unknown model", "POST", "/admin/v1/tenants", {"name": "ok", "allowed_models": ["nope"]},
         "allowed_models"),
        ("patch unknown field", "PATCH", t, {"name": "renamed"}, "name"),
        ("patch wrong type", "PATCH", t, {"disabled": "yes"}, "disabled"),
        ("patch null disabled", "PATCH", t, {"disabled": None}, "disabled"),
        ("models missing", "PUT", f"{t}/models", {}, "allowed_models"),
        ("models wrong type", "PUT", f"{t}/models", {"allowed_models": [1]}, "allowed_models[0]"),
        ("key bad role", "POST", f"{t}/keys", {"name": "k", "role": "superuser"}, "role"),
        ("key role wrong type", "POST", f"{t}/keys", {"name": "k", "role": ["member"]}, "role"),
        ("key unknown field", "POST", f"{t}/keys", {"name": "k", "role": "member", "scopes": ["*"]}, "scopes"),
        ("key empty name", "POST", f"{t}/keys", {"name": "", "role": "member"}, "name"),
        ("key short expiry", "POST", f"{t}/keys", {"name": "k", "role": "member", "expires_in_seconds": 1},
         "expires_in_seconds"),
        ("key expiry as text", "POST", f"{t}/keys", {"name": "k", "role": "member", "expires_in_seconds": "600"},
         "expires_in_seconds"),
        ("rotate negative grace", "POST", f"{t}/keys/{key.id}/rotate", {"grace_seconds": -1}, "grace_seconds"),
        ("rotate grace as bool", "POST", f"{t}/keys/{key.id}/rotate", {"grace_seconds": True}, "grace_seconds"),
        ("rotate unknown field", "POST", f"{t}/keys/{key.id}/rotate", {"grace": 5}, "grace"),
        ("binding bad role", "POST", f"{t}/role-bindings", {**rb, "role": "owner"}, "role"),
        ("binding bad kind", "POST", f"{t}/role-bindings", {**rb, "kind": "user"}, "kind"),
        ("binding unknown provider", "POST", f"{t}/role-bindings", {**rb, "provider_id": "idp_nope"}, "provider_id"),
        ("binding unknown field", "POST", f"{t}/role-bindings", {**rb, "tenant_id": "other"}, "tenant_id"),
        ("idp bad role map", "POST", "/admin/v1/oidc-providers", {**idp, "role_map": {"x": "root"}}, "role_map"),
        ("idp wrong type", "POST", "/admin/v1/oidc-providers", {**idp, "leeway_seconds": "30"}, "leeway_seconds"),
        ("idp unknown field", "POST", "/admin/v1/oidc-providers", {**idp, "secret": "x"}, "secret"),
        ("idp patch null list", "PATCH", p, {"required_claims": None}, "required_claims"),
        ("idp patch wrong type", "PATCH", p, {"enabled": "no"}, "enabled"),
        ("model bad dtype", "POST", "/admin/v1/models", {"name": "m", "path": default_model_path(), "dtype": "fp16"},
         "dtype"),
        ("model unknown field", "POST", "/admin/v1/models", {"name": "m", "path": "/x", "gpu": 1}, "gpu"),
        ("model bad name", "POST", "/admin/v1/models", {"name": "no spaces", "path": "/x"}, "name"),
    ]


def test_invalid_bodies_are_422_naming_the_field(world: World) -> None:
    for what, method, url, body, param in body_cases(world):
        version = world.store.policy_version()
        response = world.client.request(method, url, json=body, headers=world.admin)
        assert response.status_code == 422, (what, response.text)
        error = error_of(response)
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value", (what, error)
        assert error["param"] == param, (what, error)
        assert world.store.policy_version() == version, f"{what}: a refused request changed the policy"


@pytest.mark.parametrize(
    "content", [b"", b"{not json", b"[]", b'"tenant"', b"null", b"\xff\xfe{}", b"[" * 100_000], ids=repr
)
def test_bodies_that_are_not_json_objects_are_400(world: World, content: bytes) -> None:
    response = world.client.post(
        "/admin/v1/tenants", content=content, headers={**world.admin, "content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    # Nesting past the interpreter's recursion limit is refused before the syntax error is found.
    assert error_of(response)["code"] == ("json_too_deep" if content.startswith(b"[[") else "invalid_json")


WEIRD: list[Any] = [
    None, 0, -1, 10**20, 1.5, "", "x" * 5000, [], {}, True, ["x"], [None], {"a": None}, "\u0000", "é/..",
]


def test_no_value_in_any_admin_body_is_a_500(world: World) -> None:
    """Each field of each admin body, set to each odd value: refused or accepted, never a server error."""
    tenant = world.store.create_tenant("fuzz")  # a tenant of its own: some values are valid
    t = f"/admin/v1/tenants/{tenant.id}"
    provider = world.store.create_oidc_provider("fuzz", "https://fuzz.example.com", "inferflux")
    limit = world.store.create_policy(tenant.id, "rate_limit", "fuzz", {"requests_per_minute": 10**9})
    guard = world.store.create_policy(tenant.id, "guardrail", "fuzz", {"blocklist": [{"literal": "zzfuzzzz"}]})
    targets: list[tuple[str, str, type[Any], dict[str, Any]]] = [
        ("POST", "/admin/v1/tenants", TenantCreate, {"name": "fz-{i}"}),
        ("PATCH", t, TenantUpdate, {}),
        ("PUT", f"{t}/models", ModelAllowList, {"allowed_models": None}),
        ("POST", f"{t}/keys", KeyCreate, {"name": "k", "role": "member"}),
        ("POST", f"{t}/role-bindings", RoleBindingCreate,
         {"provider_id": provider.id, "kind": "subject", "subject": "s{i}", "role": "member"}),
        ("POST", "/admin/v1/oidc-providers", OidcProviderCreate,
         {"name": "fz-{i}", "issuer": "https://fz-{i}.example.com", "audience": "a"}),
        ("PATCH", f"/admin/v1/oidc-providers/{provider.id}", OidcProviderUpdate, {}),
        ("POST", "/admin/v1/models", ModelLoadRequest, {"name": "fz-{i}", "path": "/nonexistent"}),
        ("POST", f"{t}/policies", TrafficPolicyCreate,
         {"kind": "rate_limit", "name": "p", "spec": {"requests_per_minute": 10**9}}),
        ("PATCH", f"{t}/policies/{limit.id}", TrafficPolicyUpdate, {}),
        ("POST", "/admin/v1/guardrails", GuardrailCreate,
         {"tenant_id": tenant.id, "name": "g", "spec": {}}),
        ("PATCH", f"/admin/v1/guardrails/{guard.id}?tenant_id={tenant.id}", GuardrailUpdate, {}),
    ]
    failures = []
    n = 0
    for method, url, model, base in targets:
        for name in model.model_fields:
            for value in WEIRD:
                n += 1
                body = {k: v.format(i=n) if isinstance(v, str) else v for k, v in base.items()}
                body[name] = value
                response = world.client.request(method, url, json=body, headers=world.admin)
                if response.status_code >= 500 or response.status_code == 202:
                    failures.append((method, url, name, repr(value)[:20], response.status_code, response.text[:200]))
                elif response.status_code >= 400:
                    error_of(response)
    assert not failures
    # The weirdest path params too.
    for path_id in ("%00", "x" * 5000, "é", "%2E%2E", "a%20b"):
        for url in (f"/admin/v1/tenants/{path_id}", f"{t}/keys/{path_id}", f"/admin/v1/oidc-providers/{path_id}",
                    f"/admin/v1/models/{path_id}"):
            response = world.client.get(url, headers=world.admin)
            assert response.status_code == 404, (url[:80], response.text)


# -- keys are shown once -------------------------------------------------------------------------


def test_a_created_key_is_shown_once_and_only_by_prefix_after(world: World) -> None:
    client, acme = world.client, world.acme
    t = f"/admin/v1/tenants/{acme.id}"
    created = client.post(f"{t}/keys", json={"name": "ci", "role": "member"}, headers=world.acme_admin)
    assert created.status_code == 201
    body = created.json()
    key = body.pop("key")
    assert set(body) == API_KEY_FIELDS
    _, prefix, secret = key.split("_")
    assert body["prefix"] == prefix and body["object"] == "api_key"

    fetched = client.get(f"{t}/keys/{body['id']}", headers=world.acme_admin)
    listed = client.get(f"{t}/keys", params={"limit": 200}, headers=world.acme_admin)
    audit = client.get(f"{t}/audit", params={"limit": 200}, headers=world.acme_admin)
    as_admin = client.get(f"{t}/keys", params={"limit": 200}, headers=world.admin)
    assert set(fetched.json()) == API_KEY_FIELDS
    assert all(set(item) == API_KEY_FIELDS for item in listed.json()["data"])
    assert prefix in [item["prefix"] for item in listed.json()["data"]]
    for response in (fetched, listed, audit, as_admin):
        assert response.status_code == 200
        assert secret not in response.text and key not in response.text
    # The key works, and rotation shows the new key once in the same way.
    assert client.get("/v1/models", headers=bearer(key)).status_code == 200
    rotated = client.post(f"{t}/keys/{body['id']}/rotate", json={"grace_seconds": 0}, headers=world.acme_admin).json()
    new_secret = rotated["key"].split("_")[2]
    assert new_secret not in client.get(f"{t}/keys/{rotated['id']}", headers=world.acme_admin).text


# -- admin events ------------------------------------------------------------------------------


def test_changes_are_recorded_in_their_tenants_audit_only(world: World) -> None:
    client, store, acme = world.client, world.store, world.acme
    t = f"/admin/v1/tenants/{acme.id}"
    audit_url = f"{t}/audit"
    # Earlier tests' refusals (say, the 422s above) are counted in windows that end up to 10 s later, when
    # their aggregates are written: end them now, so that none lands among this test's events.
    trail = client.app.state.audit_trail
    for aggregate in trail.refusals.due(everything=True):
        trail.record_nowait(aggregate)
    # Wait until the index holds everything done so far, so that "before" is complete.
    marker = admin_event(principal="test", action="audit.marker", target_kind="tenant", tenant_id=acme.id)
    client.portal.call(client.app.state.audit_trail.record, marker)
    before = {e["id"] for e in eventually(
        lambda: client.get(audit_url, params={"limit": 200}, headers=world.acme_admin).json()["data"],
        lambda data: marker.id in {e["id"] for e in data},
    )}  # fmt: skip
    globex_before = client.get(
        f"/admin/v1/tenants/{world.globex.id}/audit", params={"limit": 200}, headers=world.globex_admin
    ).json()["data"]

    key = client.post(f"{t}/keys", json={"name": "audited", "role": "viewer"}, headers=world.acme_admin).json()
    rotated = client.post(f"{t}/keys/{key['id']}/rotate", json={"grace_seconds": 60}, headers=world.acme_admin).json()
    client.post(f"{t}/keys/{rotated['id']}/revoke", headers=world.acme_admin)
    binding = client.post(
        f"{t}/role-bindings",
        json={"provider_id": world.provider.id, "kind": "subject", "subject": "auditor", "role": "viewer"},
        headers=world.acme_admin,
    ).json()
    client.delete(f"{t}/role-bindings/{binding['id']}", headers=world.acme_admin)
    client.patch(t, json={"display_name": "ACME Corp"}, headers=world.admin)
    client.put(f"{t}/models", json={"allowed_models": None}, headers=world.admin)
    # Recorded as a refusal (issue 18), not as a change; not recorded: a read, and a change at the platform level.
    refused = client.post(f"{t}/keys", json={"name": "x", "role": "platform-admin"}, headers=world.acme_admin)
    client.get(f"{t}/keys", headers=world.acme_admin)
    platform_level = {"name": "plat", "issuer": "https://plat.example.com", "audience": "a"}
    client.post("/admin/v1/oidc-providers", json=platform_level, headers=world.admin)

    events = eventually(
        lambda: [e for e in client.get(audit_url, params={"limit": 200}, headers=world.acme_admin).json()["data"]
                 if e["id"] not in before],
        lambda new: len(new) >= 16,  # 8 outcomes (7 changes, 1 refusal) and their 8 attempts
    )
    me, admin = world.acme_admin_subject, world.admin_subject
    # Every change (and the refused key) had its attempt recorded first, in acme's log too.
    attempts = [e for e in events if e["action"] == "attempt"]
    assert len(attempts) == 8 and all(e["tenant_id"] == acme.id for e in attempts), attempts
    events = [e for e in events if e["action"] != "attempt"]
    refusals = [e for e in events if e["decision"] != "allow"]
    assert [(e["route"], e["status"], e["principal"], e["reasons"]) for e in refusals] == [
        ("POST /admin/v1/tenants/{tenant_id}/keys", refused.status_code, me, [refused.json()["error"]["code"]])]
    events = [e for e in events if e["decision"] == "allow"]
    assert [(e["action"], e["target_id"], e["principal"]) for e in events] == [
        ("key.create", key["id"], me),
        ("key.rotate", key["id"], me),
        ("key.revoke", rotated["id"], me),
        ("role_binding.create", binding["id"], me),
        ("role_binding.delete", binding["id"], me),
        ("tenant.update", acme.id, admin),
        ("tenant.models", acme.id, admin),
    ]
    assert all(e["tenant_id"] == acme.id and e["object"] == "audit_event" and e["kind"] == "admin" and e["at"]
               for e in events)
    assert events[1]["detail"]["new_key"] == rotated["id"]
    # The platform admin sees the same log; globex's is untouched, and its admin cannot read acme's.
    seen_by_admin = client.get(audit_url, params={"limit": 200}, headers=world.admin).json()["data"]
    assert [e for e in seen_by_admin if e["decision"] == "allow" and e["action"] != "attempt"][-len(events):] == events
    globex_after = client.get(
        f"/admin/v1/tenants/{world.globex.id}/audit", params={"limit": 200}, headers=world.globex_admin
    ).json()["data"]
    assert globex_after == globex_before
    assert client.get(audit_url, headers=world.globex_admin).status_code == 404


def test_a_new_tenants_audit_starts_with_its_creation(world: World) -> None:
    created = world.client.post("/admin/v1/tenants", json={"name": "fresh"}, headers=world.admin).json()
    events = eventually(
        lambda: world.client.get(f"/admin/v1/tenants/{created['id']}/audit", headers=world.admin).json()["data"],
        lambda data: len(data) > 0,
    )
    assert [(e["action"], e["target_id"]) for e in events] == [("tenant.create", created["id"])]


# -- disabled tenants --------------------------------------------------------------------------


def test_a_disabled_tenants_keys_stop_working_and_come_back(world: World) -> None:
    client, store = world.client, world.store
    tenant = store.create_tenant("umbrella")
    _, member = store.create_api_key(tenant.id, "app", "member")
    _, admin = store.create_api_key(tenant.id, "admin", "tenant-admin")
    for key in (member, admin):
        assert client.get("/admin/v1/whoami", headers=bearer(key)).status_code == 200  # cached from here on

    disabled = client.patch(f"/admin/v1/tenants/{tenant.id}", json={"disabled": True}, headers=world.admin)
    assert disabled.status_code == 200 and disabled.json()["disabled"] is True
    # 401, not 403: the key no longer proves an identity at all (as for a revoked key), so the
    # client is told to get new credentials, not that its role is too small.
    for key in (member, admin):
        response = client.get("/v1/models", headers=bearer(key))
        assert response.status_code == 401, response.text
        assert error_of(response)["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    assert client.patch(f"/admin/v1/tenants/{tenant.id}", json={"disabled": False},
                        headers=bearer(admin)).status_code == 401  # it cannot re-enable itself
    assert client.get("/v1/models", headers=world.acme_admin).status_code == 200  # others are unaffected

    enabled = client.patch(f"/admin/v1/tenants/{tenant.id}", json={"disabled": False}, headers=world.admin)
    assert enabled.status_code == 200
    assert client.get("/v1/models", headers=bearer(member)).status_code == 200


def test_deleting_a_tenant_removes_its_keys(world: World) -> None:
    client, store = world.client, world.store
    tenant = store.create_tenant("doomed")
    _, key = store.create_api_key(tenant.id, "app", "member")
    assert client.get("/v1/models", headers=bearer(key)).status_code == 200
    assert client.delete(f"/admin/v1/tenants/{tenant.id}", headers=world.admin).status_code == 204
    assert client.get("/v1/models", headers=bearer(key)).status_code == 401
    assert client.get(f"/admin/v1/tenants/{tenant.id}", headers=world.admin).status_code == 404
    assert client.delete(f"/admin/v1/tenants/{tenant.id}", headers=world.admin).status_code == 404


# -- OIDC providers ------------------------------------------------------------------------------


def test_oidc_provider_lifecycle_never_returns_the_client_secret(world: World) -> None:
    client, store = world.client, world.store
    secret, newer = "s3cr3t-first-value", "s3cr3t-second-value"
    created = client.post(
        "/admin/v1/oidc-providers",
        json={"name": "okta", "issuer": "https://okta.example.com", "audience": "inferflux", "client_id": "app",
              "client_secret": secret, "role_map": {"ml-team": "member"}, "tenant_ids": [world.acme.id]},
        headers=world.admin,
    )
    assert created.status_code == 201, created.text
    provider = created.json()
    pid = provider["id"]
    url = f"/admin/v1/oidc-providers/{pid}"
    assert provider["object"] == "oidc_provider" and "client_secret" not in provider
    assert provider["has_client_secret"] is True and provider["role_map"] == {"ml-team": "member"}
    assert (provider["tenant_id"], provider["tenant_ids"], provider["allow_platform"]) == (None, [world.acme.id], False)
    assert store.get_oidc_provider(pid).client_secret == secret  # stored (encrypted), only not shown

    fetched = client.get(url, headers=world.admin)
    listed = client.get("/admin/v1/oidc-providers", params={"limit": 200}, headers=world.admin)
    assert fetched.json() == provider
    assert provider in listed.json()["data"]

    patched = client.patch(url, json={"leeway_seconds": 5}, headers=world.admin)
    assert patched.status_code == 200 and patched.json()["leeway_seconds"] == 5
    assert patched.json()["has_client_secret"] is True
    replaced = client.patch(url, json={"client_secret": newer}, headers=world.admin)
    assert replaced.json()["has_client_secret"] is True and store.get_oidc_provider(pid).client_secret == newer
    for response in (created, fetched, listed, patched, replaced):
        assert secret not in response.text and newer not in response.text
    events = wait_indexed(
        client.app, lambda events: sum(e["target_id"] == pid for e in events) >= 3  # create, update, update
    )
    assert not any(secret in json.dumps(e) or newer in json.dumps(e) for e in events)
    assert {"oidc_provider.create", "oidc_provider.update"} <= {e["action"] for e in events if e["target_id"] == pid}

    cleared = client.patch(url, json={"client_secret": None}, headers=world.admin)
    assert cleared.status_code == 200 and cleared.json()["has_client_secret"] is False
    assert client.patch(url, json={"issuer": "https://elsewhere.example.com"}, headers=world.admin).status_code == 422

    store.create_role_binding(world.acme.id, provider_id=pid, kind="group", subject="ml-team", role="member")
    assert client.delete(url, headers=world.admin).status_code == 204
    assert client.get(url, headers=world.admin).status_code == 404
    assert client.delete(url, headers=world.admin).status_code == 404
    assert client.patch(url, json={"leeway_seconds": 1}, headers=world.admin).status_code == 404
    assert all(b.provider_id != pid for b in store.list_role_bindings(world.acme.id, limit=200).items)


def test_duplicate_providers_and_tenants_are_409(world: World) -> None:
    client = world.client
    again = client.post(
        "/admin/v1/oidc-providers",
        # The same issuer to a verifier, and the same audience: tokens could not tell the two apart.
        json={"name": "other", "issuer": world.provider.issuer + "/", "audience": world.provider.audience},
        headers=world.admin,
    )
    assert again.status_code == 409 and error_of(again)["code"] == "conflict"
    other_app = {"name": "other", "issuer": world.provider.issuer, "audience": "another-app"}
    assert client.post("/admin/v1/oidc-providers", json=other_app, headers=world.admin).status_code == 201
    assert client.post("/admin/v1/tenants", json={"name": "acme"}, headers=world.admin).status_code == 409


# -- the model admin, without loading anything -------------------------------------------------------


def test_model_admin_refuses_bad_loads_before_starting_one(world: World, tmp_path: Path) -> None:
    client, admin = world.client, world.admin
    good = {"name": "second", "path": default_model_path(), "dtype": "float32"}
    (tmp_path / "empty").mkdir()
    for body, status, param in [
        ({**good, "path": "/nonexistent/model.gguf"}, 422, "path"),
        ({**good, "path": str(tmp_path / "empty")}, 422, "path"),  # a directory without config.json
        ({**good, "path": "/" + "x" * 5000}, 422, "path"),  # a name the OS refuses outright
        ({**good, "backend": "no-such-backend"}, 422, "backend"),
        ({**good, "name": MODEL}, 409, "name"),  # taken by the configured model
        ({**good, "aliases": ["smollm2"]}, 409, "name"),  # its alias too
    ]:
        response = client.post("/admin/v1/models", json=body, headers=admin)
        assert response.status_code == status, (body, response.text)
        assert error_of(response)["param"] == param
    assert client.post("/admin/v1/models", json=good, headers=world.acme_admin).status_code == 404  # platform-only
    assert [m["id"] for m in client.get("/admin/v1/models", headers=admin).json()["data"]] == [MODEL]
    assert world.store.list_served_models() == []

    assert client.delete(f"/admin/v1/models/{MODEL}", headers=admin).status_code == 409  # from the configuration
    for method, url in [("GET", "/admin/v1/models/nope"), ("DELETE", "/admin/v1/models/nope"),
                        ("POST", "/admin/v1/models/nope/default")]:
        response = client.request(method, url, headers=admin)
        assert response.status_code == 404 and error_of(response)["code"] == "not_found", (method, url)
    by_alias = client.get("/admin/v1/models/smollm2", headers=admin).json()
    assert by_alias["id"] == MODEL and by_alias["source"] == "config" and by_alias["status"] == "ready"


def test_making_a_configured_model_the_default_clears_the_stored_mark(world: World) -> None:
    # An admin-loaded model recorded as the default (as if loaded with default=true before a restart).
    # Its path loads nothing: the app, which follows the store's registry, tries it and fails at once.
    store = world.store
    record = store.create_served_model("ghost", path="/nonexistent/ghost.gguf", dtype="float32", is_default=True)
    try:
        response = world.client.post(f"/admin/v1/models/{MODEL}/default", headers=world.admin)
        assert response.status_code == 200, response.text
        assert response.json()["id"] == MODEL and response.json()["default"] is True
        # Otherwise the next start would hand the default back to "ghost".
        assert store.get_served_model(record.id).is_default is False
        wait_indexed(
            world.client.app, lambda events: any(e["action"] == "model.default" and e["target_id"] == MODEL
                                                 for e in events)
        )  # fmt: skip
    finally:
        store.delete_served_model(record.id)


@dataclass
class FakeServed:
    """Stands in for a loaded model, so that a load's later steps can be tested without loading one."""

    name: str
    aliases: tuple[str, ...] = ()
    backend: str = "cpu"
    created: int = 0
    max_model_len: int = 64
    stopped: int = 0

    @property
    def engine(self) -> Any:
        return type("Engine", (), {"is_running": self.stopped == 0})()

    @property
    def info(self) -> Any:
        return type("Info", (), {"dtype": "float32", "architecture": "fake"})()

    def shutdown(self) -> None:
        self.stopped += 1


def test_a_load_that_cannot_be_recorded_is_not_left_serving(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose record cannot be written (here: the store refuses it) is failed and unserved."""
    import time

    from inferflux.gateway.models import admin as model_admin
    from inferflux.policy.errors import Conflict

    store, client, admin = world.store, world.client, world.admin
    fakes: list[FakeServed] = []

    def refuse(**record: Any) -> None:
        # What the store answers when another replica registered the name first. (A real record
        # holding it would do, but this app follows the registry: it would load that one instead.)
        raise Conflict(f"A model named '{record['name']}' is already registered")

    def fake_load(spec: Any, *args: Any) -> FakeServed:
        fakes.append(FakeServed(spec.name, tuple(spec.aliases)))
        return fakes[-1]

    monkeypatch.setattr(model_admin, "load_served_model", fake_load)
    monkeypatch.setattr(store, "create_served_model", refuse)
    started = client.post(
        "/admin/v1/models", json={"name": "stale", "path": default_model_path(), "default": True}, headers=admin
    )
    assert started.status_code == 202, started.text
    deadline = time.monotonic() + 30
    while (status := client.get("/admin/v1/models/stale", headers=admin).json())["status"] == "loading":
        assert time.monotonic() < deadline, status
        time.sleep(0.02)
    assert status["status"] == "failed" and status["error"], status
    assert [f.stopped for f in fakes] == [1]
    # Not served with its stopped engine, and the default is what it was.
    assert "stale" not in [m["id"] for m in client.get("/v1/models", headers=admin).json()["data"]]
    listed = {m["id"]: m for m in client.get("/admin/v1/models", headers=admin).json()["data"]}
    assert listed[MODEL]["default"] is True and listed["stale"]["status"] == "failed"
    assert client.delete("/admin/v1/models/stale", headers=admin).status_code == 204  # forget the failure
