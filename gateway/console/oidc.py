"""Console sign-in through an OIDC provider: authorization code with PKCE (S256) and a nonce, through authlib.

A provider takes part when it is enabled, platform-owned (the sign-in page is
public: a tenant's own providers would name the tenant) and has a
``client_id``; its discovery document gives the authorization and token
endpoints. The pending sign-in (state, PKCE verifier, nonce) stays on the
server for ``PENDING_SECONDS``, bound to the browser by a cookie. The ID token
that comes back is then proved by the API's own ``Authenticator`` (signature,
issuer, audience, expiry, the tenant and role bindings), so a console session
is exactly what that token would be on the API.
"""

from __future__ import annotations

import base64
import hmac
import json
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import httpx
from authlib.common.security import generate_token
from authlib.integrations.httpx_client import AsyncOAuth2Client
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from inferflux.gateway.auth import call_store
from inferflux.gateway.console.sessions import COOKIE_PATH
from inferflux.policy.errors import AuthenticationError, NotFound, PolicyError
from inferflux.policy.store import PolicyStore

PENDING_SECONDS = 600
MAX_PENDING = 10_000
BINDING_COOKIE = "inferflux_console_oidc"
_TIMEOUT = 10.0


class IdpUnavailable(PolicyError):
    status_code = 503
    error_type = "server_error"
    default_code = "idp_unavailable"


@dataclass
class _Pending:
    provider_id: str
    verifier: str
    nonce: str
    binding: str
    next_path: str
    token_endpoint: str
    expires: float


class OidcLogin:
    def __init__(self, store: PolicyStore, clock: Any = time.time) -> None:
        self.store = store
        self._clock = clock
        self._pending: OrderedDict[str, _Pending] = OrderedDict()

    async def providers(self) -> list[dict[str, str]]:
        """The providers a user may sign in with: id and name."""
        try:
            records = await call_store(self.store.list_enabled_oidc_providers)
        except PolicyError:
            return []  # the API-key form still works while the store recovers
        return [{"id": r.id, "name": r.name} for r in records if r.tenant_id is None and r.client_id]

    async def start(self, request: Request, provider_id: str) -> Response:
        record = await self._provider(provider_id)
        endpoints = await _discover(record.issuer)
        verifier, nonce, binding = generate_token(64), secrets.token_urlsafe(24), secrets.token_urlsafe(32)
        async with self._client(record, request) as client:
            url, state = client.create_authorization_url(
                endpoints["authorization_endpoint"], code_verifier=verifier, nonce=nonce
            )
        next_path = request.query_params.get("next", "/console/")
        self._pending[state] = _Pending(record.id, verifier, nonce, binding, next_path,
                                        endpoints["token_endpoint"], self._clock() + PENDING_SECONDS)  # fmt: skip
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
        response = RedirectResponse(url, status_code=303)
        # Lax, not Strict: the browser comes back from the provider's site, and must bring it.
        response.set_cookie(BINDING_COOKIE, binding, max_age=PENDING_SECONDS, path=COOKIE_PATH, httponly=True,
                            samesite="lax", secure=request.url.scheme == "https")  # fmt: skip
        return response

    async def finish(self, request: Request) -> tuple[str, str]:
        """The callback: (the verified provider's ID token, where to go next); 401 for anything amiss."""
        pending = self._pending.pop(request.query_params.get("state", ""), None)
        binding = request.cookies.get(BINDING_COOKIE, "")
        if pending is None or pending.expires <= self._clock() or not hmac.compare_digest(pending.binding, binding):
            raise AuthenticationError("Unknown or expired sign-in; start again", code="invalid_oidc_state")
        if "error" in request.query_params:
            raise AuthenticationError(f"The identity provider refused: {request.query_params['error'][:200]}",
                                      code="oidc_refused")  # fmt: skip
        record = await self._provider(pending.provider_id)
        async with self._client(record, request) as client:
            try:
                token = await client.fetch_token(pending.token_endpoint, code=request.query_params.get("code", ""),
                                                 code_verifier=pending.verifier)  # fmt: skip
            except httpx.HTTPError:
                raise IdpUnavailable("The identity provider's token endpoint is unreachable") from None
            except Exception as exc:  # authlib's OAuthError: the provider refused the code
                raise AuthenticationError(f"The identity provider refused the code: {str(exc)[:200]}",
                                          code="oidc_refused") from None  # fmt: skip
        id_token = token.get("id_token")
        if not isinstance(id_token, str) or _claims(id_token).get("nonce") != pending.nonce:
            raise AuthenticationError("The identity provider's answer has no ID token for this sign-in",
                                      code="invalid_oidc_token")  # fmt: skip
        return id_token, pending.next_path

    async def _provider(self, provider_id: str) -> Any:
        refused = NotFound("No identity provider for console sign-in with this id")
        try:
            record = await call_store(self.store.get_oidc_provider, provider_id)
        except NotFound:
            raise refused from None
        if not record.enabled or record.tenant_id is not None or not record.client_id:
            raise refused
        return record

    @staticmethod
    def _client(record: Any, request: Request) -> AsyncOAuth2Client:
        redirect = f"{request.url.scheme}://{request.url.netloc}{COOKIE_PATH}/oidc/callback"
        return AsyncOAuth2Client(
            client_id=record.client_id,
            client_secret=record.client_secret,
            scope="openid profile",
            redirect_uri=redirect,
            code_challenge_method="S256",
            token_endpoint_auth_method="client_secret_post" if record.client_secret else "none",
            timeout=_TIMEOUT,
            follow_redirects=False,
        )


def continue_page(target: str) -> HTMLResponse:
    """A same-site page that moves on to ``target``: a SameSite=Strict cookie set on a response to a cross-site
    navigation is not sent on that navigation's redirects, so the first signed-in page is reached from here."""
    body = (f'<!doctype html><meta http-equiv="refresh" content="0;url={target}"><title>Signed in</title>'
            f'<a href="{target}">Continue</a>')  # fmt: skip
    return HTMLResponse(body)


async def _discover(issuer: str) -> dict[str, str]:
    url = issuer.rstrip("/") + "/.well-known/openid-configuration"
    try:
        async with httpx.AsyncClient(timeout=_TIMEOUT, follow_redirects=False) as client:
            response = await client.get(url)
            response.raise_for_status()
            document = response.json()
    except (httpx.HTTPError, ValueError):
        raise IdpUnavailable("The identity provider's discovery document is unavailable") from None
    endpoints = {k: document.get(k) for k in ("authorization_endpoint", "token_endpoint")}
    if document.get("issuer") != issuer or not all(isinstance(v, str) and v for v in endpoints.values()):
        raise IdpUnavailable("The identity provider does not offer the authorization code flow")
    return endpoints  # type: ignore[return-value]


def _claims(token: str) -> dict[str, Any]:
    """The payload of a JWT, unverified (the nonce only: the authenticator verifies the token after)."""
    try:
        payload = token.split(".")[1]
        data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
