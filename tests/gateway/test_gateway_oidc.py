"""OIDC bearer tokens through the whole gateway, over real sockets, against a real loopback IdP.

The verifier's rules are tested one by one in tests/policy/authn; here every
attack case goes through the HTTP stack and must come back 401 with a clear
code: never a success, never a 500.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from idp import EC_KID, ED_KID, RSA_KID, LoopbackIdP, hand_built_token, hmac_token, running_idp
from servers import start_uvicorn, stop_uvicorn

from inferflux.gateway.auth import Authenticator
from inferflux.policy.authn.oidc import OidcVerifier
from inferflux.policy.store import PolicyStore, StoreSettings

CHAT = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def idp() -> Iterator[LoopbackIdP]:
    with running_idp() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(make_app: Any, idp: LoopbackIdP, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data_dir: Path = tmp_path_factory.mktemp("oidc")
    store = PolicyStore.open(StoreSettings(), data_dir)
    admin = store.ensure_bootstrap_admin()
    # A short key-refresh interval, so the rotation case needs no 30 s wait; a fast poll for the revocation cases.
    authenticator = Authenticator(
        store, OidcVerifier((), min_refresh_interval=0.2), poll_interval=0.2, negative_ttl=0.0
    )
    server, thread, sock, url = start_uvicorn(make_app(store, authenticator))
    headers = {"authorization": f"Bearer {admin}"}
    with httpx.Client(base_url=url, timeout=60) as http:
        tenants = {}
        for name in ("acme", "globex"):
            created = http.post("/admin/v1/tenants", headers=headers, json={"name": name})
            assert created.status_code == 201, created.text
            tenants[name] = created.json()
        # Platform-owned, for both tenants and (it maps "root" to platform-admin) the platform tenant.
        provider = http.post(
            "/admin/v1/oidc-providers",
            headers=headers,
            json={
                "name": "loopback",
                "issuer": idp.issuer,
                "audience": "inferflux",
                "tenant_ids": [t["id"] for t in tenants.values()],
                "allow_platform": True,
                "role_map": {"engineer": "member", "boss": "tenant-admin", "root": "platform-admin"},
            },
        )
        assert provider.status_code == 201, provider.text
        try:
            yield {"http": http, "admin": headers, "provider": provider.json(), "tenants": tenants, "store": store}
        finally:
            stop_uvicorn(server, thread, sock)
            store.close()


def call(gateway: dict[str, Any], token: str, path: str = "/admin/v1/whoami") -> httpx.Response:
    http: httpx.Client = gateway["http"]
    headers = {"authorization": f"Bearer {token}"}
    if path == "/v1/chat/completions":
        return http.post(path, headers=headers, json=CHAT)
    return http.get(path, headers=headers)


@pytest.mark.parametrize("kid", [RSA_KID, EC_KID, ED_KID])
def test_valid_token_of_each_key_type(gateway: dict[str, Any], idp: LoopbackIdP, kid: str) -> None:
    token = idp.mint(idp.claims(sub=f"alice-{kid}", roles=["engineer"]), kid=kid)
    me = call(gateway, token)
    assert me.status_code == 200, me.text
    body = me.json()
    assert body["tenant"] == "acme" and body["roles"] == ["member"] and body["kind"] == "oidc"
    assert body["subject"] == f"oidc:{gateway['provider']['id']}:alice-{kid}"
    assert call(gateway, token, "/v1/models").status_code == 200
    assert call(gateway, token, "/v1/chat/completions").status_code == 200


def test_unmapped_role_grants_nothing_but_a_binding_does(gateway: dict[str, Any], idp: LoopbackIdP) -> None:
    acme = gateway["tenants"]["acme"]
    token = idp.mint(idp.claims(sub="bob", roles=["intern"], groups=["ml-team"]), kid=RSA_KID)
    denied = call(gateway, token)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "no_role"

    http, admin = gateway["http"], gateway["admin"]
    bind = {"provider_id": gateway["provider"]["id"], "kind": "group", "subject": "ml-team", "role": "viewer"}
    binding = http.post(f"/admin/v1/tenants/{acme['id']}/role-bindings", headers=admin, json=bind)
    assert binding.status_code == 201, binding.text
    token = idp.mint(idp.claims(sub="bob", roles=["intern"], groups=["ml-team"], jti="2"), kid=RSA_KID)
    me = call(gateway, token)
    assert me.status_code == 200 and me.json()["roles"] == ["viewer"]
    # A viewer reads but does not generate.
    assert call(gateway, token, "/v1/chat/completions").status_code == 403

    subject = {"provider_id": gateway["provider"]["id"], "kind": "subject", "subject": "bob", "role": "member"}
    assert http.post(f"/admin/v1/tenants/{acme['id']}/role-bindings", headers=admin, json=subject).status_code == 201
    assert call(gateway, token, "/v1/chat/completions").status_code == 200  # roles merge: viewer + member


def test_platform_admin_claim_counts_only_in_the_platform_tenant(gateway: dict[str, Any], idp: LoopbackIdP) -> None:
    token = idp.mint(idp.claims(sub="mallory", roles=["root", "engineer"]), kid=RSA_KID)
    me = call(gateway, token)
    assert me.status_code == 200 and me.json()["roles"] == ["member"]
    assert call(gateway, token, "/admin/v1/tenants").status_code == 404  # a platform-only route, to a member

    root = idp.mint(idp.claims(sub="ops", roles=["root"], tenant="platform"), kid=RSA_KID)
    assert call(gateway, root, "/admin/v1/tenants").status_code == 200


def test_tenant_claim_selects_the_tenant(gateway: dict[str, Any], idp: LoopbackIdP) -> None:
    token = idp.mint(idp.claims(sub="carol", roles=["boss"], tenant="globex"), kid=RSA_KID)
    me = call(gateway, token)
    assert me.status_code == 200 and me.json()["tenant"] == "globex" and me.json()["roles"] == ["tenant-admin"]
    acme = gateway["tenants"]["acme"]
    assert call(gateway, token, f"/admin/v1/tenants/{acme['id']}/keys").status_code == 404


def attack_tokens(idp: LoopbackIdP) -> dict[str, tuple[str, str]]:
    """name -> (token, expected error code)."""
    now = time.time()
    good = idp.claims(roles=["engineer"])
    signed = idp.mint(good, kid=RSA_KID)
    head, payload, signature = signed.split(".")
    tampered_payload = idp.mint({**good, "tenant": "globex"}, kid=RSA_KID).split(".")[1]
    flipped = signature[:-2] + ("AA" if not signature.endswith("AA") else "BB")
    return {
        "expired": (idp.mint(idp.claims(now - 3600, roles=["engineer"]), kid=RSA_KID), "token_expired"),
        "not yet valid": (idp.mint(idp.claims(roles=["engineer"], nbf=int(now) + 600), kid=RSA_KID), "token_not_yet_valid"),
        "wrong issuer": (idp.mint(idp.claims(roles=["engineer"], iss="https://evil.example"), kid=RSA_KID), "unknown_issuer"),
        "wrong audience": (idp.mint(idp.claims(audience="someone-else", roles=["engineer"]), kid=RSA_KID), "invalid_audience"),
        "tampered payload": (f"{head}.{tampered_payload}.{signature}", "invalid_signature"),
        "tampered signature": (f"{head}.{payload}.{flipped}", "invalid_signature"),
        "alg none": (hand_built_token({"alg": "none", "kid": RSA_KID}, good), "unsupported_algorithm"),
        "HS256 with the public key": (
            hmac_token({"alg": "HS256", "kid": RSA_KID}, good, idp.public_pem(RSA_KID)),
            "unsupported_algorithm",
        ),
        "missing tenant claim": (idp.mint(idp.claims(roles=["engineer"], tenant=None), kid=RSA_KID), "missing_tenant_claim"),
        "unknown tenant": (idp.mint(idp.claims(roles=["engineer"], tenant="nobody"), kid=RSA_KID), "tenant_not_allowed"),
        "unknown kid": (idp.mint(good, kid=idp.add_key("RSA", publish=False)), "unknown_key"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "expired",
        "not yet valid",
        "wrong issuer",
        "wrong audience",
        "tampered payload",
        "tampered signature",
        "alg none",
        "HS256 with the public key",
        "missing tenant claim",
        "unknown tenant",
        "unknown kid",
    ],
)
@pytest.mark.parametrize("path", ["/admin/v1/whoami", "/v1/models", "/v1/chat/completions"])
def test_attacks_are_401_with_a_clear_code(gateway: dict[str, Any], idp: LoopbackIdP, case: str, path: str) -> None:
    token, code = attack_tokens(idp)[case]
    response = call(gateway, token, path)
    assert response.status_code == 401, f"{case}: {response.status_code} {response.text}"
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == code, f"{case}: {error}"
    assert error["message"] and response.headers["www-authenticate"] == "Bearer"


def test_unknown_kid_then_key_rotation(gateway: dict[str, Any], idp: LoopbackIdP) -> None:
    # The IdP rotates: a token signed with the new key makes the gateway re-fetch the JWKS once.
    old = idp.mint(idp.claims(sub="dave", roles=["engineer"]), kid=RSA_KID)
    assert call(gateway, old).status_code == 200
    new_kid = idp.rotate(RSA_KID)
    try:
        time.sleep(0.3)  # past the verifier's refresh interval (0.2 s in this fixture)
        fetches = idp.jwks_fetches
        new = idp.mint(idp.claims(sub="dave", roles=["engineer"]), kid=new_kid)
        assert call(gateway, new).status_code == 200
        assert idp.jwks_fetches == fetches + 1
        # The withdrawn key no longer verifies new tokens.
        stale = idp.mint(idp.claims(sub="erin", roles=["engineer"]), kid=RSA_KID)
        response = call(gateway, stale)
        assert response.status_code == 401 and response.json()["error"]["code"] == "unknown_key"
    finally:
        idp.publish(RSA_KID)
        time.sleep(0.3)  # let the next unknown-kid refresh pick it up again


def test_disabled_tenant_and_disabled_provider_stop_tokens(gateway: dict[str, Any], idp: LoopbackIdP) -> None:
    http, admin = gateway["http"], gateway["admin"]
    store: PolicyStore = gateway["store"]
    tenant = http.post("/admin/v1/tenants", headers=admin, json={"name": "hooli"}).json()
    token = idp.mint(idp.claims(sub="gavin", roles=["engineer"], tenant="hooli"), kid=RSA_KID)
    # A tenant made after the provider is not in its list until added.
    refused = call(gateway, token)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "tenant_not_allowed"
    provider_url = f"/admin/v1/oidc-providers/{gateway['provider']['id']}"
    tenant_ids = [*gateway["provider"]["tenant_ids"], tenant["id"]]
    assert http.patch(provider_url, headers=admin, json={"tenant_ids": tenant_ids}).status_code == 200
    assert call(gateway, token).status_code == 200
    # A change made directly in the store (as another replica would) is seen within the poll interval.
    store.update_tenant(tenant["id"], disabled=True)
    response = wait_for_status(gateway, token, 401, within=2.0)
    assert response.json()["error"]["code"] == "tenant_disabled"
    store.update_tenant(tenant["id"], disabled=False)
    wait_for_status(gateway, token, 200, within=2.0)

    provider = gateway["provider"]["id"]
    assert http.patch(f"/admin/v1/oidc-providers/{provider}", headers=admin, json={"enabled": False}).status_code == 200
    try:
        response = call(gateway, token)  # the admin change is effective at once on this replica
        assert response.status_code == 401 and response.json()["error"]["code"] == "unknown_issuer"
    finally:
        http.patch(f"/admin/v1/oidc-providers/{provider}", headers=admin, json={"enabled": True})
    assert call(gateway, token).status_code == 200


def wait_for_status(gateway: dict[str, Any], token: str, status: int, within: float) -> httpx.Response:
    deadline = time.monotonic() + within
    while True:
        response = call(gateway, token)
        if response.status_code == status or time.monotonic() > deadline:
            assert response.status_code == status, response.text
            return response
        time.sleep(0.05)


def test_identity_provider_down_is_503_not_500(gateway: dict[str, Any], idp: LoopbackIdP) -> None:
    new_kid = idp.add_key("EC", publish=False)
    token = idp.mint(idp.claims(sub="frank", roles=["engineer"]), kid=new_kid)
    idp.fail_with = 500
    try:
        time.sleep(0.3)
        response = call(gateway, token)
        assert response.status_code in (401, 503), response.text
        assert response.status_code != 500
    finally:
        idp.fail_with = None
