"""The admin API for traffic policies (rate limits, quotas) and guardrail policies (issue 4).

CRUD through the gateway; validation errors naming the field; who may write
what (a tenant admin reads its limits but cannot raise them, and writes its
own guardrails); other tenants' policies answering like missing ones; the
write-only ``sensitive_spec``; and every change reaching the resolvers the
request path uses, on this replica at once and on another after a refresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from inferflux.policy.guardrails import GuardrailResolver
from inferflux.policy.ratelimit import PolicyResolver
from inferflux.policy.rbac import Principal
from admin_seed import Seeded, seeded_app
from audit_wait import wait_indexed
from http_helpers import error_of

REGO = """package inferflux.guardrails
import rego.v1
decision := {"allow": true, "reasons": []}
"""
SECRET_WORD = "bluebirdzz"
OPA_TOKEN = "opa-token-never-shown-0123456789"


@dataclass
class World(Seeded):
    app: Any
    client: TestClient
    data_dir: Path  # the app's


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    data_dir: Path = tmp_path_factory.mktemp("admin-policies")
    with seeded_app(make_app, data_dir) as (seeded, app, client):
        yield World(**seeded.seeded(), app=app, client=client, data_dir=data_dir / "app")


def policies_url(tenant_id: str | None) -> str:
    return "/admin/v1/policies" if tenant_id is None else f"/admin/v1/tenants/{tenant_id}/policies"


def member_of(world: World) -> Principal:
    """The principal authentication makes for acme's member key."""
    key = world.acme_member
    return Principal(world.acme.id, "acme", f"key:{key.prefix}", "api_key", frozenset({"member"}), key_id=key.id)


def assert_422s(world: World, headers: dict[str, str], cases: list[tuple[str, str, str, Any, str]]) -> None:
    """Each (what, method, url, body, param) request is a 422 naming ``param``, and changes no policy."""
    for what, method, url, body, param in cases:
        version = world.store.policy_version()
        response = world.client.request(method, url, json=body, headers=headers)
        assert response.status_code == 422, (what, response.text)
        error = error_of(response)
        assert error["param"] == param and error["code"] == "invalid_value", (what, error)
        assert world.store.policy_version() == version, what


# -- traffic policies --------------------------------------------------------------------------


@pytest.mark.parametrize("tenant", ["acme", None], ids=["tenant", "global"])
def test_traffic_policy_lifecycle(world: World, tenant: str | None) -> None:
    client, store = world.client, world.store
    tenant_id = world.acme.id if tenant else None
    url = policies_url(tenant_id)
    spec = {"requests_per_minute": 600, "per_key": {"requests_per_minute": 60}}
    body = {"kind": "rate_limit", "name": "standard", "spec": spec}
    created = client.post(url, json=body, headers=world.admin)
    assert created.status_code == 201, created.text
    policy = created.json()
    assert policy["object"] == "policy" and policy["tenant_id"] == tenant_id and policy["kind"] == "rate_limit"
    assert policy["spec"] == body["spec"] and policy["enabled"] is True and "sensitive_spec" not in policy
    assert store.get_policy(tenant_id, policy["id"]).spec == body["spec"]

    reader = world.acme_admin if tenant else world.admin  # the tenant admin reads its own tenant's limits
    one = f"{url}/{policy['id']}"
    assert client.get(one, headers=reader).json() == policy
    assert policy in client.get(url, params={"limit": 200}, headers=reader).json()["data"]

    patched = client.patch(one, json={"spec": {"requests_per_minute": 300}, "enabled": False}, headers=world.admin)
    assert patched.status_code == 200, patched.text
    assert patched.json()["spec"] == {"requests_per_minute": 300} and patched.json()["enabled"] is False
    assert patched.json()["name"] == "standard" and patched.json()["kind"] == "rate_limit"

    quota = client.post(url, json={"kind": "quota", "name": "monthly",
                                   "spec": {"period": "month", "tokens": 5_000_000}}, headers=world.admin)  # fmt: skip
    assert quota.status_code == 201, quota.text
    quotas = client.get(url, params={"kind": "quota", "limit": 200}, headers=reader).json()["data"]
    assert [p["id"] for p in quotas if p["id"] in (policy["id"], quota.json()["id"])] == [quota.json()["id"]]

    for made in (policy, quota.json()):
        assert client.delete(f"{url}/{made['id']}", headers=world.admin).status_code == 204
        assert client.get(f"{url}/{made['id']}", headers=reader).status_code == 404
        assert client.delete(f"{url}/{made['id']}", headers=world.admin).status_code == 404


def test_lists_hold_only_their_own_traffic_policies(world: World) -> None:
    client, store, acme = world.client, world.store, world.acme
    own = store.create_policy(acme.id, "rate_limit", "own", {"requests_per_minute": 10**9})
    global_ = store.create_policy(None, "rate_limit", "everyone", {"requests_per_minute": 10**9})
    guard = store.create_policy(acme.id, "guardrail", "g", {"blocklist": [{"literal": "zzlistzz"}]})
    other = store.create_policy(world.globex.id, "rate_limit", "theirs", {"requests_per_minute": 10**9})
    try:
        tenant_ids = {p["id"] for p in client.get(policies_url(acme.id), params={"limit": 200},
                                                   headers=world.acme_admin).json()["data"]}  # fmt: skip
        global_ids = {p["id"] for p in client.get(policies_url(None), params={"limit": 200},
                                                   headers=world.admin).json()["data"]}  # fmt: skip
        assert own.id in tenant_ids and not {global_.id, guard.id, other.id} & tenant_ids
        assert global_.id in global_ids and not {own.id, guard.id, other.id} & global_ids
        # The guardrail is not a traffic policy, under either path.
        for url in (f"{policies_url(acme.id)}/{guard.id}", f"{policies_url(None)}/{global_.id}x"):
            assert client.get(url, headers=world.admin).status_code == 404
        bad_kind = client.get(policies_url(acme.id), params={"kind": "guardrail"}, headers=world.admin)
        assert bad_kind.status_code == 422 and error_of(bad_kind)["param"] == "kind"
    finally:
        for policy in (own, global_, guard, other):
            store.delete_policy(policy.tenant_id, policy.id)


def test_a_tenant_admin_reads_its_limits_but_cannot_write_them(world: World) -> None:
    client, store, acme = world.client, world.store, world.acme
    policy = store.create_policy(acme.id, "rate_limit", "granted", {"requests_per_minute": 60})
    url = f"{policies_url(acme.id)}/{policy.id}"
    version = store.policy_version()
    assert client.get(url, headers=world.acme_admin).status_code == 200
    for method, target, body, status in [
        ("POST", policies_url(acme.id), {"kind": "rate_limit", "name": "more", "spec": {"requests_per_minute": 10**6}},
         403),
        ("PATCH", url, {"spec": {"requests_per_minute": 10**6}}, 403),
        ("PATCH", url, {"enabled": False}, 403),
        ("DELETE", url, None, 403),
        # The global limits are platform-only routes: to a tenant admin, routes that do not exist.
        ("GET", policies_url(None), None, 404),
        ("POST", policies_url(None), {"kind": "rate_limit", "name": "all", "spec": {"requests_per_minute": 1}}, 404),
    ]:  # fmt: skip
        response = client.request(method, target, json=body, headers=world.acme_admin)
        assert response.status_code == status, (method, target, response.text)
        assert error_of(response)["code"] == ("insufficient_scope" if status == 403 else "not_found")
    assert store.policy_version() == version
    assert store.get_policy(acme.id, policy.id).spec == {"requests_per_minute": 60}
    store.delete_policy(acme.id, policy.id)


def test_invalid_traffic_policies_are_422_naming_the_field(world: World) -> None:
    client, acme, store = world.client, world.acme, world.store
    globex_key, _ = store.create_api_key(world.globex.id, "theirs", "member")
    existing = store.create_policy(acme.id, "rate_limit", "existing", {"requests_per_minute": 5})
    t, g = policies_url(acme.id), policies_url(None)
    one = f"{t}/{existing.id}"
    rl = {"kind": "rate_limit", "name": "x"}
    cases: list[tuple[str, str, str, Any, str]] = [
        ("unknown kind", "POST", t, {**rl, "kind": "guardrail", "spec": {}}, "kind"),
        ("missing spec", "POST", t, rl, "spec"),
        ("spec not an object", "POST", t, {**rl, "spec": [1]}, "spec"),
        ("no limit", "POST", t, {**rl, "spec": {}}, "spec"),
        ("zero", "POST", t, {**rl, "spec": {"requests_per_minute": 0}}, "spec.requests_per_minute"),
        ("bool", "POST", t, {**rl, "spec": {"tokens_per_minute": True}}, "spec.tokens_per_minute"),
        ("text", "POST", t, {**rl, "spec": {"concurrent_requests": "5"}}, "spec.concurrent_requests"),
        ("misspelt limit", "POST", t, {**rl, "spec": {"request_per_minute": 5}}, "spec.request_per_minute"),
        ("per_key bad", "POST", t, {**rl, "spec": {"per_key": {"requests_per_minute": -1}}},
         "spec.per_key.requests_per_minute"),
        ("quota no period", "POST", t, {"kind": "quota", "name": "q", "spec": {"tokens": 5}}, "spec.period"),
        ("quota bad period", "POST", t, {"kind": "quota", "name": "q", "spec": {"period": "week", "tokens": 5}},
         "spec.period"),
        ("key scope no principal", "POST", t, {**rl, "spec": {"scope": "key", "requests_per_minute": 5}},
         "spec.principal"),
        ("another tenant's key", "POST", t,
         {**rl, "spec": {"scope": "key", "principal": globex_key.id, "requests_per_minute": 5}}, "spec.principal"),
        ("another tenant's prefix", "POST", t,
         {**rl, "spec": {"scope": "key", "principal": f"key:{globex_key.prefix}", "requests_per_minute": 5}},
         "spec.principal"),
        ("no such provider", "POST", t,
         {**rl, "spec": {"scope": "key", "principal": "oidc:idp_nope:alice", "requests_per_minute": 5}},
         "spec.principal"),
        ("no subject", "POST", t,
         {**rl, "spec": {"scope": "key", "principal": f"oidc:{world.provider.id}:", "requests_per_minute": 5}},
         "spec.principal"),
        ("not a principal", "POST", t,
         {**rl, "spec": {"scope": "key", "principal": "alice", "requests_per_minute": 5}}, "spec.principal"),
        ("global key scope", "POST", g,
         {**rl, "spec": {"scope": "key", "principal": "key_x", "requests_per_minute": 5}}, "spec.scope"),
        ("unknown field", "POST", t, {**rl, "spec": {"requests_per_minute": 5}, "tenant_id": "x"}, "tenant_id"),
        ("empty name", "POST", t, {**rl, "name": "", "spec": {"requests_per_minute": 5}}, "name"),
        ("enabled as text", "POST", t, {**rl, "spec": {"requests_per_minute": 5}, "enabled": "yes"}, "enabled"),
        ("patch null name", "PATCH", one, {"name": None}, "name"),
        ("patch null spec", "PATCH", one, {"spec": None}, "spec"),
        ("patch bad spec", "PATCH", one, {"spec": {"requests_per_minute": 10**13}}, "spec.requests_per_minute"),
        ("patch kind", "PATCH", one, {"kind": "quota"}, "kind"),
        ("patch spec of the other kind", "PATCH", one, {"spec": {"period": "day", "tokens": 5}}, "spec.period"),
    ]
    assert_422s(world, world.admin, cases)
    assert store.get_policy(acme.id, existing.id).spec == {"requests_per_minute": 5}
    store.delete_policy(acme.id, existing.id)


def test_a_key_scoped_policy_names_a_key_or_subject_of_the_tenant(world: World) -> None:
    client, acme, key = world.client, world.acme, world.acme_member
    made = []
    for principal in (key.id, f"key:{key.prefix}", f"oidc:{world.provider.id}:alice"):
        body = {"kind": "rate_limit", "name": "one", "spec": {"scope": "key", "principal": principal,
                                                                "requests_per_minute": 5}}  # fmt: skip
        response = client.post(policies_url(acme.id), json=body, headers=world.admin)
        assert response.status_code == 201, (principal, response.text)
        made.append(response.json()["id"])
    for policy_id in made:
        world.store.delete_policy(acme.id, policy_id)


# -- tenancy -----------------------------------------------------------------------------------


def test_other_tenants_policies_answer_like_missing_ones(world: World) -> None:
    client, store, acme, globex = world.client, world.store, world.acme, world.globex
    limit = store.create_policy(globex.id, "rate_limit", "theirs", {"requests_per_minute": 5})
    guard = store.create_policy(globex.id, "guardrail", "theirs", {"blocklist": [{"literal": "zztheirszz"}]})
    version = store.policy_version()
    missing = "pol_" + "z" * (len(limit.id) - 4)
    for policy_id in (limit.id, guard.id):
        for method, body in (("GET", None), ("PATCH", {"enabled": False}), ("DELETE", None)):
            for url in (f"/admin/v1/guardrails/{policy_id}", f"/admin/v1/guardrails/{policy_id}?tenant_id={globex.id}",
                        f"{policies_url(globex.id)}/{policy_id}", f"{policies_url(acme.id)}/{policy_id}"):
                seen = client.request(method, url, json=body, headers=world.acme_admin)
                gone = client.request(method, url.replace(policy_id, missing).replace(globex.id, "ten_" + "z" * 16),
                                      json=body, headers=world.acme_admin)  # fmt: skip
                if seen.status_code == 403:  # writing limits: refused on scope before anything is looked up
                    assert method != "GET" and "/policies/" in url and gone.status_code == 403
                    continue
                assert seen.status_code == 404 and gone.status_code == 404, (method, url, seen.text)
                assert error_of(seen)["code"] == "not_found"
    # The platform admin reaches them only through their own tenant.
    assert client.get(f"{policies_url(acme.id)}/{limit.id}", headers=world.admin).status_code == 404
    assert client.get(f"/admin/v1/guardrails/{guard.id}", headers=world.admin).status_code == 404
    assert client.get(f"/admin/v1/guardrails/{guard.id}?tenant_id={globex.id}", headers=world.admin).status_code == 200
    assert client.get(f"{policies_url(globex.id)}/{limit.id}", headers=world.admin).status_code == 200
    # A guardrail is not reachable as a traffic policy, nor the reverse.
    assert client.get(f"{policies_url(globex.id)}/{guard.id}", headers=world.admin).status_code == 404
    assert client.get(f"/admin/v1/guardrails/{limit.id}?tenant_id={globex.id}",
                      headers=world.admin).status_code == 404  # fmt: skip
    # A tenant admin cannot create in another tenant, nor list it.
    body = {"tenant_id": globex.id, "name": "mine", "spec": {"blocklist": [{"literal": "zzminezz"}]}}
    assert client.post("/admin/v1/guardrails", json=body, headers=world.acme_admin).status_code == 404
    listed = client.get("/admin/v1/guardrails", params={"tenant_id": globex.id}, headers=world.acme_admin)
    assert listed.status_code == 404
    assert store.policy_version() == version
    assert store.get_policy(globex.id, guard.id).enabled and store.get_policy(globex.id, limit.id).enabled
    store.delete_policy(globex.id, limit.id)
    store.delete_policy(globex.id, guard.id)


# -- guardrail policies --------------------------------------------------------------------------


def test_guardrail_lifecycle_never_returns_the_sensitive_spec(world: World) -> None:
    client, store, acme = world.client, world.store, world.acme
    sensitive = {"blocklist": [{"id": "project", "literal": SECRET_WORD}], "opa_token": OPA_TOKEN}
    created = client.post(
        "/admin/v1/guardrails",
        json={"name": "acme rules", "spec": {"pii": {"email": "redact"}, "blocklist": [{"literal": "zzskizz"}]},
              "sensitive_spec": sensitive},
        headers=world.acme_admin,
    )  # fmt: skip
    assert created.status_code == 201, created.text
    policy = created.json()
    pid = policy["id"]
    assert policy["object"] == "guardrail_policy" and policy["tenant_id"] == acme.id and policy["kind"] == "guardrail"
    assert policy["has_sensitive_spec"] is True and "sensitive_spec" not in policy
    stored = store.get_policy(acme.id, pid)
    assert SECRET_WORD in (stored.sensitive_spec or "") and OPA_TOKEN in (stored.sensitive_spec or "")

    url = f"/admin/v1/guardrails/{pid}"
    fetched = client.get(url, headers=world.acme_admin)
    listed = client.get("/admin/v1/guardrails", params={"limit": 200}, headers=world.acme_admin)
    by_admin = client.get(url, params={"tenant_id": acme.id}, headers=world.admin)
    assert fetched.json() == policy and by_admin.json() == policy and policy in listed.json()["data"]
    renamed = client.patch(url, json={"name": "renamed"}, headers=world.acme_admin)
    assert renamed.status_code == 200 and renamed.json()["has_sensitive_spec"] is True
    assert store.get_policy(acme.id, pid).sensitive_spec == stored.sensitive_spec  # kept when not sent
    replaced = client.patch(url, json={"sensitive_spec": {"blocklist": [{"literal": SECRET_WORD + "x"}]}},
                            headers=world.acme_admin)  # fmt: skip
    assert replaced.status_code == 200 and replaced.json()["has_sensitive_spec"] is True
    cleared = client.patch(url, json={"sensitive_spec": None}, headers=world.acme_admin)
    assert cleared.status_code == 200 and cleared.json()["has_sensitive_spec"] is False
    assert store.get_policy(acme.id, pid).sensitive_spec is None

    responses = (created, fetched, listed, by_admin, renamed, replaced, cleared)
    assert not any(SECRET_WORD in r.text or OPA_TOKEN in r.text for r in responses)
    # Nor in the audit trail: not in the indexed events, not anywhere in the spool's files.
    events = wait_indexed(world.app, lambda es: sum(e["target_id"] == pid for e in es) >= 4, acme.id)
    assert [e["action"] for e in events if e["target_id"] == pid] == [
        "guardrail.create", "guardrail.update", "guardrail.update", "guardrail.update"
    ]
    spooled = b"".join(p.read_bytes() for p in (world.data_dir / "audit").rglob("*") if p.is_file())
    assert pid.encode() in spooled
    assert SECRET_WORD.encode() not in spooled and OPA_TOKEN.encode() not in spooled

    assert client.delete(url, headers=world.acme_admin).status_code == 204
    assert client.get(url, headers=world.acme_admin).status_code == 404


def test_invalid_guardrails_are_422_naming_the_field(world: World) -> None:
    client, store = world.client, world.store
    existing = store.create_policy(world.acme.id, "guardrail", "existing", {"blocklist": [{"literal": "zzokzz"}]})
    one = f"/admin/v1/guardrails/{existing.id}"
    g = {"name": "g"}
    cases: list[tuple[str, str, str, Any, str]] = [
        ("missing spec", "POST", "/admin/v1/guardrails", g, "spec"),
        ("unknown spec field", "POST", "/admin/v1/guardrails", {**g, "spec": {"blocklists": []}}, "spec"),
        ("rule without text", "POST", "/admin/v1/guardrails", {**g, "spec": {"blocklist": [{"id": "a"}]}},
         "spec.blocklist[0]"),
        ("bad regex", "POST", "/admin/v1/guardrails", {**g, "spec": {"blocklist": [{"regex": "(unclosed"}]}},
         "spec.blocklist[0].regex"),
        ("bad action", "POST", "/admin/v1/guardrails",
         {**g, "spec": {"blocklist": [{"literal": "x", "action": "shout"}]}}, "spec.blocklist[0].action"),
        ("bad pii mode", "POST", "/admin/v1/guardrails", {**g, "spec": {"pii": {"email": "hide"}}},
         "spec.pii.email.mode"),
        ("bad rego", "POST", "/admin/v1/guardrails",
         {**g, "spec": {"opa": {"engine": "embedded", "rego": "package x\nthis is not rego"}}}, "spec.opa.rego"),
        ("bad sensitive rule", "POST", "/admin/v1/guardrails",
         {**g, "spec": {}, "sensitive_spec": {"blocklist": [{"literal": ""}]}}, "sensitive_spec.blocklist[0].literal"),
        ("sensitive unknown field", "POST", "/admin/v1/guardrails",
         {**g, "spec": {}, "sensitive_spec": {"password": "x"}}, "sensitive_spec"),
        ("sensitive not an object", "POST", "/admin/v1/guardrails", {**g, "spec": {}, "sensitive_spec": "x"},
         "sensitive_spec"),
        ("unknown body field", "POST", "/admin/v1/guardrails", {**g, "spec": {}, "kind": "rate_limit"}, "kind"),
        ("bad global flag", "GET", "/admin/v1/guardrails?global=yes", None, "global"),
        ("patch null spec", "PATCH", one, {"spec": None}, "spec"),
        ("patch bad spec", "PATCH", one, {"spec": {"direction": "sideways"}}, "spec.direction"),
    ]
    assert_422s(world, world.acme_admin, cases)
    store.delete_policy(world.acme.id, existing.id)


def test_global_guardrails_and_remote_opa_are_the_platforms(world: World) -> None:
    client, store = world.client, world.store
    remote = {"opa": {"engine": "remote", "url": "http://127.0.0.1:9", "path": "inferflux/guardrails/decision"}}
    embedded = {"opa": {"engine": "embedded", "rego": REGO}}
    version = store.policy_version()
    for method, url, body in [
        ("POST", "/admin/v1/guardrails", {"name": "r", "spec": remote}),
        ("POST", "/admin/v1/guardrails", {"tenant_id": None, "name": "all", "spec": embedded}),
        ("GET", "/admin/v1/guardrails?global=true", None),
    ]:
        response = client.request(method, url, json=body, headers=world.acme_admin)
        assert response.status_code == 403, (method, url, response.text)
        assert error_of(response)["type"] == "permission_error"
    assert store.policy_version() == version

    own = client.post("/admin/v1/guardrails", json={"name": "mine", "spec": embedded}, headers=world.acme_admin)
    assert own.status_code == 201, own.text
    # A tenant admin cannot turn its own policy into a remote one either.
    own_url = f"/admin/v1/guardrails/{own.json()['id']}"
    to_remote = client.patch(own_url, json={"spec": remote}, headers=world.acme_admin)
    assert to_remote.status_code == 403

    made = client.post("/admin/v1/guardrails", json={"tenant_id": None, "name": "all", "spec": remote},
                       headers=world.admin)  # fmt: skip
    assert made.status_code == 201 and made.json()["tenant_id"] is None, made.text
    listed = client.get("/admin/v1/guardrails", params={"global": "true"}, headers=world.admin).json()["data"]
    assert made.json()["id"] in [p["id"] for p in listed]
    both = client.get("/admin/v1/guardrails", params={"global": "true", "tenant_id": world.acme.id},
                      headers=world.admin)  # fmt: skip
    assert both.status_code == 422 and error_of(both)["param"] == "global"
    url = f"/admin/v1/guardrails/{made.json()['id']}"
    assert client.get(url, headers=world.admin).status_code == 404  # the platform tenant's: not there
    assert client.delete(url, params={"global": "true"}, headers=world.admin).status_code == 204
    store.delete_policy(world.acme.id, own.json()["id"])


# -- changes reach the request path ----------------------------------------------------------------


def test_policy_changes_reach_the_resolvers(world: World) -> None:
    client, store, acme = world.client, world.store, world.acme
    member = member_of(world)
    app_limits: PolicyResolver = world.app.state.limiter.limits
    app_guardrails: GuardrailResolver = world.app.state.guardrails
    # Another replica's resolvers: they see a change after their next refresh.
    replica_limits = PolicyResolver(store, poll_interval=3600)
    replica_guardrails = GuardrailResolver(store, poll_seconds=3600)

    def limits() -> tuple[int | None, int | None]:
        async def both() -> tuple[Any, Any]:
            return await app_limits.limits_for(member), await replica_limits.limits_for(member)

        here, there = client.portal.call(both)
        assert here == there
        return here.tenant.requests_per_minute, here.key.requests_per_minute

    def blocked(text: str) -> bool:
        here = app_guardrails.get(acme.id).check_input([text]).blocked
        assert replica_guardrails.get(acme.id).check_input([text]).blocked is here
        return here

    def replica_refresh() -> None:
        asyncio.run(replica_limits.refresh())
        replica_guardrails.invalidate()

    assert limits() == (None, None) and not blocked("say zzforbiddenzz")
    url = policies_url(acme.id)
    made = client.post(url, json={"kind": "rate_limit", "name": "l",
                                  "spec": {"requests_per_minute": 70, "per_key": {"requests_per_minute": 7}}},
                       headers=world.admin).json()  # fmt: skip
    rule = {"name": "g", "spec": {"blocklist": [{"literal": "zzforbiddenzz"}]}}
    guard = client.post("/admin/v1/guardrails", json=rule, headers=world.acme_admin).json()
    replica_refresh()
    assert limits() == (70, 7) and blocked("say zzforbiddenzz") and not blocked("say something else")

    client.patch(f"{url}/{made['id']}", json={"spec": {"requests_per_minute": 50}}, headers=world.admin)
    client.patch(f"/admin/v1/guardrails/{guard['id']}", json={"enabled": False}, headers=world.acme_admin)
    replica_refresh()
    assert limits() == (50, None) and not blocked("say zzforbiddenzz")

    client.delete(f"{url}/{made['id']}", headers=world.admin)
    client.delete(f"/admin/v1/guardrails/{guard['id']}", headers=world.acme_admin)
    replica_refresh()
    assert limits() == (None, None)
    client.portal.call(replica_guardrails.aclose)
