"""Console sign-in through OIDC: authorization code + PKCE (authlib) against a loopback provider that checks both.

The provider (``CodeFlowIdP``: ``LoopbackIdP`` with an authorization and a token
endpoint) refuses a token request whose ``code_verifier`` does not hash to the
authorization request's S256 ``code_challenge``, a reused code, another
redirect URI or a wrong client secret; the console must get through it, prove
the ID token with the API's authenticator and keep the session only as long
as the API would accept the token.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from admin_seed import Seeded, seed_store
from console_support import console_app, sibling
from http_helpers import error_of
from idp import RSA_KID, LoopbackIdP

CLIENT_ID, CLIENT_SECRET = "inferflux-console", "console-secret"


class CodeFlowIdP(LoopbackIdP):
    """Signs in ``self.user`` at once (no login page) and checks the code exchange as a real provider does."""

    def __init__(self) -> None:
        super().__init__()
        self.user = "alice"
        self.authorizations: list[dict[str, str]] = []
        self._codes: dict[str, dict[str, str]] = {}

    def routes(self) -> list[Route]:
        return [Route("/authorize", self._authorize), Route("/token", self._token, methods=["POST"])]

    def start(self) -> CodeFlowIdP:
        super().start()
        self.discovery_overrides = {"authorization_endpoint": self.issuer + "/authorize",
                                    "token_endpoint": self.issuer + "/token"}  # fmt: skip
        return self

    async def _authorize(self, request: Request) -> Response:
        params = dict(request.query_params)
        self.authorizations.append(params)
        if params.get("response_type") != "code" or params.get("code_challenge_method") != "S256":
            return JSONResponse({"error": "invalid_request"}, status_code=400)
        code = secrets.token_urlsafe(16)
        self._codes[code] = params
        return RedirectResponse(f"{params['redirect_uri']}?{urlencode({'code': code, 'state': params['state']})}",
                                status_code=302)  # fmt: skip

    async def _token(self, request: Request) -> Response:
        form = {k: v[0] for k, v in parse_qs((await request.body()).decode()).items()}
        asked = self._codes.pop(form.get("code", ""), None)
        challenge = base64.urlsafe_b64encode(hashlib.sha256(form.get("code_verifier", "").encode()).digest())
        if (asked is None or form.get("grant_type") != "authorization_code"
                or form.get("redirect_uri") != asked["redirect_uri"] or form.get("client_id") != CLIENT_ID
                or form.get("client_secret") != CLIENT_SECRET
                or challenge.rstrip(b"=").decode() != asked["code_challenge"]):  # fmt: skip
            return JSONResponse({"error": "invalid_grant"}, status_code=400)
        claims = self.claims(sub=self.user, aud=CLIENT_ID, nonce=asked.get("nonce"), tenant="acme")
        return JSONResponse({"access_token": secrets.token_urlsafe(16), "token_type": "Bearer", "expires_in": 300,
                             "id_token": self.mint(claims, kid=RSA_KID)})  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Seeded, Any, CodeFlowIdP, Any]]:
    data_dir: Path = tmp_path_factory.mktemp("console-oidc")
    seeded = seed_store(data_dir)
    with CodeFlowIdP() as idp:
        idp.add_key("RSA", kid=RSA_KID)
        provider = seeded.store.create_oidc_provider("corp-sso", idp.issuer, CLIENT_ID, tenant_ids=[seeded.acme.id],
                                                     client_id=CLIENT_ID, client_secret=CLIENT_SECRET)  # fmt: skip
        app = console_app(seeded.store, data_dir / "app")
        try:
            with TestClient(app) as main:
                yield seeded, main, idp, provider
        finally:
            seeded.store.close()


def _through_idp(client: TestClient, provider_id: str, next_path: str = "/console/") -> httpx.Response:
    """Start at the console, let the provider sign in, and answer its redirect back: the callback's answer."""
    start = client.get(f"/console/oidc/{provider_id}/start", params={"next": next_path}, follow_redirects=False)
    assert start.status_code == 303, start.text
    authorized = httpx.get(start.headers["location"], follow_redirects=False)
    assert authorized.status_code == 302, authorized.text
    back = urlsplit(authorized.headers["location"])
    return client.get(f"{back.path}?{back.query}", follow_redirects=False)


def test_code_flow_with_pkce_signs_in_as_the_api_would(world: tuple[Seeded, Any, CodeFlowIdP, Any]) -> None:
    seeded, main, idp, provider = world
    binding = seeded.store.create_role_binding(seeded.acme.id, provider_id=provider.id, kind="subject",
                                               subject="alice", role="tenant-admin")  # fmt: skip
    client = sibling(main)
    assert "Sign in with corp-sso" in client.get("/console/login").text
    keys = f"/console/tenants/{seeded.acme.id}/keys"
    done = _through_idp(client, provider.id, keys)
    assert done.status_code == 200 and f'content="0;url={keys}"' in done.text, done.text
    asked = idp.authorizations[-1]
    assert asked["client_id"] == CLIENT_ID and "openid" in asked["scope"].split() and asked["nonce"]
    assert len(asked["code_challenge"]) == 43  # S256: a SHA-256 digest, base64url without padding
    page = client.get(keys)
    assert page.status_code == 200 and "oidc:" in page.text
    # The same RBAC and tenancy as the API: another tenant is a 404, a platform page too.
    assert client.get(f"/console/api/tenants/{seeded.globex.id}/keys").status_code == 404
    assert client.get("/console/api/tenants").status_code == 404
    # The binding removed: the API would refuse the token (no role), so the session ends.
    seeded.store.delete_role_binding(seeded.acme.id, binding.id)
    deadline = time.monotonic() + 10  # the authenticator's policy poll (auth.revocation_poll_seconds)
    while client.get(keys, follow_redirects=False).status_code != 303:
        assert time.monotonic() < deadline, "the session outlived its role binding"
        time.sleep(0.2)


def test_a_callback_is_used_once_and_only_by_the_browser_that_started_it(
    world: tuple[Seeded, Any, CodeFlowIdP, Any],
) -> None:
    seeded, main, idp, provider = world
    seeded.store.create_role_binding(seeded.acme.id, provider_id=provider.id, kind="subject", subject="bob",
                                     role="viewer")  # fmt: skip
    idp.user = "bob"
    starter, other = sibling(main), sibling(main)
    start = starter.get(f"/console/oidc/{provider.id}/start", follow_redirects=False)
    back = urlsplit(httpx.get(start.headers["location"], follow_redirects=False).headers["location"])
    stolen = other.get(f"{back.path}?{back.query}", follow_redirects=False)  # no binding cookie
    assert stolen.status_code == 401 and "Unknown or expired sign-in" in stolen.text
    assert other.get("/console/", follow_redirects=False).status_code == 303
    # The state was spent by that attempt: the right browser cannot reuse it either.
    assert starter.get(f"{back.path}?{back.query}", follow_redirects=False).status_code == 401
    # A provider that does not take part in console sign-in: the same 404 as an unknown id.
    missing = starter.get("/console/oidc/idp_missing/start", follow_redirects=False)
    corp = starter.get(f"/console/oidc/{seeded.provider.id}/start", follow_redirects=False)  # no client_id
    assert missing.status_code == corp.status_code == 404
    # A viewer signs in and sees what a viewer may: its own identity, not the tenant's keys (the API's 403).
    assert _through_idp(starter, provider.id).status_code == 200
    assert starter.get("/console/").status_code == 200
    api_refusal = starter.get(f"/console/api/tenants/{seeded.acme.id}/keys")
    assert api_refusal.status_code == 403 and error_of(api_refusal)["code"] == "insufficient_scope"
