"""Tenant-bound identity providers, through the whole gateway over real sockets (issue 18).

Two tenants each bring their own IdP (a real OIDC provider on loopback each), registered by
their own tenant admins; a third IdP is the platform's, registered twice with two audiences:
once for acme only, once for the platform tenant (with platform-admin). Every cross-mapping a
hostile IdP administrator could try is refused with 401 ``tenant_not_allowed`` and audited:
a token claiming another tenant, the platform tenant, platform-admin, a tenant outside a
platform provider's list.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from idp import RSA_KID, LoopbackIdP, running_idp
from servers import start_uvicorn, stop_uvicorn

from inferflux.gateway.auth import Authenticator
from inferflux.policy.authn.oidc import OidcVerifier
from inferflux.policy.store import PolicyStore, StoreSettings

ROLES = {"dev": "member", "boss": "tenant-admin"}


@pytest.fixture(scope="module")
def idps() -> Iterator[dict[str, LoopbackIdP]]:
    with running_idp() as a, running_idp() as b, running_idp() as p:
        yield {"acme": a, "globex": b, "platform": p}


@pytest.fixture(scope="module")
def world(make_app: Any, idps: dict[str, LoopbackIdP], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    data_dir: Path = tmp_path_factory.mktemp("tenant-idps")
    store = PolicyStore.open(StoreSettings(), data_dir)
    admin_key = store.ensure_bootstrap_admin()
    acme, globex = store.create_tenant("acme"), store.create_tenant("globex")
    admins = {t.name: store.create_api_key(t.id, "admin", "tenant-admin")[1] for t in (acme, globex)}
    authenticator = Authenticator(store, OidcVerifier(()), negative_ttl=0.0)
    server, thread, sock, url = start_uvicorn(make_app(store, authenticator, data_dir=str(data_dir / "app")))
    with httpx.Client(base_url=url, timeout=60) as http:
        providers = {}
        for name in ("acme", "globex"):  # each tenant admin registers its own tenant's IdP
            created = http.post("/admin/v1/oidc-providers", headers=bearer(admins[name]), json={
                "name": "sso", "issuer": idps[name].issuer, "audience": "inferflux", "role_map": ROLES})  # fmt: skip
            assert created.status_code == 201, created.text
            providers[name] = created.json()
        platform = idps["platform"].issuer
        shared = http.post("/admin/v1/oidc-providers", headers=bearer(admin_key), json={
            "name": "shared", "issuer": platform, "audience": "shared-app", "tenant_ids": [acme.id],
            "role_map": {**ROLES, "root": "tenant-admin"}})  # fmt: skip
        ops = http.post("/admin/v1/oidc-providers", headers=bearer(admin_key), json={
            "name": "ops", "issuer": platform, "audience": "ops-app", "allow_platform": True,
            "role_map": {"root": "platform-admin"}})  # fmt: skip
        assert shared.status_code == 201 and ops.status_code == 201, (shared.text, ops.text)
        providers |= {"shared": shared.json(), "ops": ops.json()}
        try:
            yield {"http": http, "store": store, "admin": bearer(admin_key), "admins": admins, "acme": acme,
                   "globex": globex, "providers": providers, "idps": idps, "spool": data_dir / "app" / "audit"}  # fmt: skip
        finally:
            stop_uvicorn(server, thread, sock)
            store.close()


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def token(world: Any, idp: str, sub: str, tenant: str, roles: list[str], audience: str = "inferflux") -> str:
    server: LoopbackIdP = world["idps"][idp]
    return server.mint(server.claims(sub=sub, tenant=tenant, roles=roles, audience=audience), kid=RSA_KID)


def spooled(world: Any) -> dict[str, dict[str, Any]]:
    """Every audit event written so far, by request id."""
    lines = [line for segment in sorted((world["spool"] / "segments").glob("*.jsonl"))
             for line in segment.read_text().splitlines()]  # fmt: skip
    return {e["event"]["request_id"]: e["event"] for e in map(json.loads, lines)}


def test_each_tenants_idp_signs_its_own_users_in(world: Any) -> None:
    for name in ("acme", "globex"):
        me = world["http"].get("/admin/v1/whoami", headers=bearer(token(world, name, f"{name}-dev", name, ["boss"])))
        assert me.status_code == 200, me.text
        assert me.json()["tenant"] == name and me.json()["roles"] == ["tenant-admin"]
        assert world["providers"][name]["tenant_id"] == world[name].id  # registered by its tenant admin
    shared = token(world, "platform", "pat", "acme", ["dev"], audience="shared-app")
    assert world["http"].get("/v1/models", headers=bearer(shared)).status_code == 200
    root = token(world, "platform", "ops-1", "platform", ["root"], audience="ops-app")
    assert world["http"].get("/admin/v1/tenants", headers=bearer(root)).status_code == 200


CROSS_MAPPINGS = [
    # (case, idp, audience, claimed tenant, roles)
    ("acme's IdP claiming globex", "acme", "inferflux", "globex", ["boss"]),
    ("globex's IdP claiming acme", "globex", "inferflux", "acme", ["dev"]),
    ("acme's IdP claiming the platform", "acme", "inferflux", "platform", ["boss"]),
    ("acme's IdP asking for platform-admin", "acme", "inferflux", "platform", ["root", "platform-admin"]),
    ("platform IdP outside its list", "platform", "shared-app", "globex", ["dev"]),
    ("platform IdP without allow_platform claiming the platform", "platform", "shared-app", "platform", ["root"]),
    ("the platform's ops IdP claiming an ordinary tenant", "platform", "ops-app", "acme", ["root"]),
    ("a tenant that does not exist", "acme", "inferflux", "initech", ["boss"]),
]


@pytest.mark.parametrize(("case", "idp", "audience", "tenant", "roles"), CROSS_MAPPINGS,
                         ids=[c[0] for c in CROSS_MAPPINGS])  # fmt: skip
def test_every_cross_mapping_is_refused_and_audited(
    world: Any, case: str, idp: str, audience: str, tenant: str, roles: list[str]
) -> None:
    credential = token(world, idp, f"mallory-{CROSS_MAPPINGS.index((case, idp, audience, tenant, roles))}", tenant,
                       roles, audience=audience)  # fmt: skip
    request_ids = []
    for path in ("/v1/models", "/admin/v1/whoami", "/admin/v1/tenants"):
        response = world["http"].get(path, headers=bearer(credential))
        assert response.status_code == 401, (case, path, response.text)
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "tenant_not_allowed", (case, error)
        # Clear, and the same whether the tenant exists or not: it names only what the token claimed.
        assert error["message"] == (f"The token's tenant '{tenant}' does not exist or is not one its identity "
                                    "provider may sign users into")  # fmt: skip
        assert response.headers["www-authenticate"] == "Bearer"
        request_ids.append(response.headers["x-request-id"])
    # The API call is on the audit trail, as every refusal is: as itself, or (the same client refused for
    # the same reason on the same route within the trail's aggregation window) counted into the first.
    events = spooled(world)
    event = events.get(request_ids[0]) or next(
        e for e in events.values()
        if e["route"] == "GET /v1/models" and e["status"] == 401 and "tenant_not_allowed" in e["reasons"]
    )  # fmt: skip
    assert event["status"] == 401 and event["decision"] == "deny" and event["tenant_id"] is None


def test_a_tenant_admin_cannot_widen_its_own_idp(world: Any) -> None:
    http, acme_admin = world["http"], bearer(world["admins"]["acme"])
    url = f"/admin/v1/oidc-providers/{world['providers']['acme']['id']}"
    version = world["store"].policy_version()
    for body, param in [
        ({"tenant_ids": [world["globex"].id]}, "tenant_ids"),
        ({"allow_platform": True}, "allow_platform"),
        ({"role_map": {"root": "platform-admin"}}, "role_map"),
    ]:
        response = http.patch(url, headers=acme_admin, json=body)
        assert response.status_code == 422 and response.json()["error"]["param"] == param, response.text
    assert world["store"].policy_version() == version
    # Nor register one for globex, or a platform-owned one.
    sso = {"name": "sneaky", "issuer": "https://sneaky.example.com", "audience": "inferflux"}
    foreign = http.post("/admin/v1/oidc-providers", headers=acme_admin, json={**sso, "tenant_id": world["globex"].id})
    assert foreign.status_code == 404 and foreign.json()["error"]["code"] == "not_found"
    platform = http.post("/admin/v1/oidc-providers", headers=acme_admin, json={**sso, "tenant_id": None})
    assert platform.status_code == 403
    assert world["store"].policy_version() == version


def test_role_bindings_honour_the_bounds(world: Any) -> None:
    http, acme = world["http"], world["acme"]
    bind = {"kind": "subject", "subject": "eve", "role": "member"}
    url = f"/admin/v1/tenants/{acme.id}/role-bindings"
    # globex's IdP cannot be bound in acme: answered exactly like an identity provider that does not exist.
    foreign = world["providers"]["globex"]["id"]
    missing = "idp_" + "z" * (len(foreign) - 4)
    seen = http.post(url, headers=bearer(world["admins"]["acme"]), json={**bind, "provider_id": foreign})
    gone = http.post(url, headers=bearer(world["admins"]["acme"]), json={**bind, "provider_id": missing})
    assert seen.status_code == gone.status_code == 422
    assert seen.json()["error"]["message"].replace(foreign, missing) == gone.json()["error"]["message"]
    # Not even by the platform admin; nor a platform provider in a tenant outside its list.
    for tenant, provider in [(acme, "globex"), (world["globex"], "shared")]:
        response = http.post(f"/admin/v1/tenants/{tenant.id}/role-bindings", headers=world["admin"],
                             json={**bind, "provider_id": world["providers"][provider]["id"]})  # fmt: skip
        assert response.status_code == 422 and response.json()["error"]["param"] == "provider_id", response.text
    # Within the bounds it works: acme's admin binds a role to a user of acme's own IdP.
    ok = http.post(url, headers=bearer(world["admins"]["acme"]), json={**bind, "provider_id": world["providers"]["acme"]["id"]})
    assert ok.status_code == 201, ok.text
    me = http.get("/admin/v1/whoami", headers=bearer(token(world, "acme", "eve", "acme", [])))
    assert me.status_code == 200 and me.json()["roles"] == ["member"]


def test_a_tenant_removed_from_a_platform_idp_loses_its_users(world: Any) -> None:
    http, admin = world["http"], world["admin"]
    shared = world["providers"]["shared"]
    credential = token(world, "platform", "pam", "acme", ["dev"], audience="shared-app")
    assert http.get("/v1/models", headers=bearer(credential)).status_code == 200  # cached from here on
    url = f"/admin/v1/oidc-providers/{shared['id']}"
    assert http.patch(url, headers=admin, json={"tenant_ids": []}).status_code == 200
    try:
        refused = http.get("/v1/models", headers=bearer(credential))
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "tenant_not_allowed"
    finally:
        assert http.patch(url, headers=admin, json={"tenant_ids": [world["acme"].id]}).status_code == 200


def test_a_token_for_two_providers_of_one_issuer_is_refused(world: Any) -> None:
    credential = token(world, "platform", "both", "acme", ["dev"], audience=["shared-app", "ops-app"])  # type: ignore[arg-type]
    response = world["http"].get("/v1/models", headers=bearer(credential))
    assert response.status_code == 401 and response.json()["error"]["code"] == "ambiguous_audience"


def test_idp_admin_lists_only_its_own_providers(world: Any) -> None:
    http = world["http"]
    for name in ("acme", "globex"):
        listed = http.get("/admin/v1/oidc-providers", headers=bearer(world["admins"][name])).json()["data"]
        assert [p["id"] for p in listed] == [world["providers"][name]["id"]]
        other = "globex" if name == "acme" else "acme"
        for method in ("GET", "PATCH", "DELETE"):
            url = f"/admin/v1/oidc-providers/{world['providers'][other]['id']}"
            response = http.request(method, url, headers=bearer(world["admins"][name]), json={"enabled": False}
                                    if method == "PATCH" else None)  # fmt: skip
            assert response.status_code == 404, (name, method, response.text)
    everything = http.get("/admin/v1/oidc-providers", headers=world["admin"]).json()["data"]
    assert {p["id"] for p in everything} == {p["id"] for p in world["providers"].values()}
