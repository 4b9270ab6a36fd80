"""A real OpenID Connect identity provider on loopback, for tests.

``LoopbackIdP`` serves ``/.well-known/openid-configuration`` and ``/jwks.json``
from a Starlette app under uvicorn on 127.0.0.1 (ephemeral port, background
thread), so verifiers are exercised over real HTTP. Keys (RSA 2048, EC P-256,
Ed25519) are generated in the test process; keys can be published, withdrawn
and rotated at run time, fetches are counted, and the IdP can be told to fail.
``mint`` signs tokens with any of its keys, published or not.

Usage::

    with LoopbackIdP() as idp:
        rsa = idp.add_key("RSA")
        token = idp.mint({"sub": "alice", "tenant": "acme"}, kid=rsa)
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import uvicorn
from joserfc import jwt
from joserfc.errors import SecurityWarning
from joserfc.jwk import ECKey, Key, OKPKey, RSAKey
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from servers import free_loopback_socket

KeyKind = Literal["RSA", "EC", "OKP"]
DEFAULT_AUDIENCE = "inferflux"
_DEFAULT_ALG: dict[str, str] = {"RSA": "RS256", "EC": "ES256", "OKP": "EdDSA"}


# The keys the shared fixture starts every test with.
RSA_KID = "rsa-1"
EC_KID = "ec-1"
ED_KID = "ed-1"


class FakeClock:
    """A settable ``time.time`` stand-in, so expiry and rate limits are tested without sleeping."""

    def __init__(self, now: float | None = None) -> None:
        self.now = time.time() if now is None else now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_json(value: Any) -> str:
    return b64url(json.dumps(value, separators=(",", ":")).encode())


def hand_built_token(header: Mapping[str, Any], claims: Mapping[str, Any], signature: bytes = b"") -> str:
    """A compact JWS assembled by hand, for tokens no JOSE library will sign (``alg: none``)."""
    return f"{b64url_json(dict(header))}.{b64url_json(dict(claims))}.{b64url(signature)}"


def hmac_token(header: Mapping[str, Any], claims: Mapping[str, Any], secret: bytes) -> str:
    """An HS256 token signed with an arbitrary secret (the key-confusion attack uses a public key's PEM)."""
    signing_input = f"{b64url_json(dict(header))}.{b64url_json(dict(claims))}"
    signature = hmac.new(secret, signing_input.encode("ascii"), hashlib.sha256).digest()
    return f"{signing_input}.{b64url(signature)}"


def closed_loopback_url() -> str:
    """The URL of a loopback port nothing listens on (connection refused)."""
    sock = free_loopback_socket()
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


class LoopbackIdP:
    """An OIDC provider serving discovery and JWKS over real HTTP on 127.0.0.1."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[str, Key] = {}
        self._published: list[str] = []
        self._counter = 0
        self.jwks_fetches = 0
        self.discovery_fetches = 0
        # When set, every route answers with this HTTP status instead.
        self.fail_with: int | None = None
        # Overrides for the discovery document's fields (e.g. a wrong issuer).
        self.discovery_overrides: dict[str, Any] = {}
        # When set, served verbatim as the JWKS body.
        self.raw_jwks: bytes | None = None
        self._sock: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.issuer = ""

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> LoopbackIdP:
        self._sock = free_loopback_socket()
        self.issuer = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        app = Starlette(
            routes=[
                Route("/.well-known/openid-configuration", self._discovery),
                Route("/jwks.json", self._jwks),
                # A redirect to the real key set: a verifier must not follow it.
                Route("/moved", lambda request: RedirectResponse("/jwks.json", status_code=302)),
                *self.routes(),
            ]
        )
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="loopback-idp", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the loopback IdP did not start")
            time.sleep(0.01)
        return self

    def routes(self) -> list[Route]:
        """More routes a subclass serves (an authorization code flow's endpoints)."""
        return []

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._sock = None

    def __enter__(self) -> LoopbackIdP:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reset(self, published: list[str] | None = None) -> None:
        """Back to a known state between tests: counters zeroed, failures off, ``published`` keys served."""
        with self._lock:
            self.jwks_fetches = 0
            self.discovery_fetches = 0
            self.fail_with = None
            self.discovery_overrides = {}
            self.raw_jwks = None
            if published is not None:
                self._published = list(published)

    # -- keys ----------------------------------------------------------------

    def add_key(self, kind: KeyKind, *, kid: str | None = None, publish: bool = True, **params: Any) -> str:
        """Generate a signing key; returns its kid. Unpublished keys still sign (the IdP 'about to rotate')."""
        with self._lock:
            self._counter += 1
            kid = kid or f"{kind.lower()}-{self._counter}"
        if kind == "RSA":
            key: Key = RSAKey.generate_key(2048, parameters={"kid": kid, **params})
        elif kind == "EC":
            key = ECKey.generate_key("P-256", parameters={"kid": kid, **params})
        else:
            key = OKPKey.generate_key("Ed25519", parameters={"kid": kid, **params})
        with self._lock:
            self._keys[kid] = key
            if publish and kid not in self._published:
                self._published.append(kid)
        return kid

    def publish(self, kid: str) -> None:
        with self._lock:
            if kid not in self._published:
                self._published.append(kid)

    def withdraw(self, kid: str) -> None:
        with self._lock:
            if kid in self._published:
                self._published.remove(kid)

    def rotate(self, old_kid: str, kind: KeyKind | None = None) -> str:
        """Publish a new key of the same kind and drop ``old_kid``; returns the new kid."""
        new_kid = self.add_key(kind or self.kind_of(old_kid))
        self.withdraw(old_kid)
        return new_kid

    def kind_of(self, kid: str) -> KeyKind:
        return self._keys[kid].key_type  # type: ignore[return-value]

    def key(self, kid: str) -> Key:
        return self._keys[kid]

    def public_pem(self, kid: str) -> bytes:
        return self._keys[kid].as_pem(private=False)

    @property
    def published(self) -> list[str]:
        with self._lock:
            return list(self._published)

    def jwks(self) -> dict[str, Any]:
        with self._lock:
            return {"keys": [self._keys[kid].as_dict(private=False, use="sig") for kid in self._published]}

    # -- tokens --------------------------------------------------------------

    def claims(self, now: float | None = None, *, audience: Any = DEFAULT_AUDIENCE, **extra: Any) -> dict[str, Any]:
        """A complete, valid claim set at ``now``; keyword arguments add or override claims (None removes)."""
        now = time.time() if now is None else now
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "sub": "user-1",
            "aud": audience,
            "iat": int(now),
            "exp": int(now) + 300,
            "tenant": "acme",
        }
        claims.update(extra)
        return {name: value for name, value in claims.items() if value is not None}

    def mint(
        self,
        claims: Mapping[str, Any],
        *,
        kid: str,
        alg: str | None = None,
        header: Mapping[str, Any] | None = None,
        include_kid: bool = True,
    ) -> str:
        """Sign ``claims`` with key ``kid`` (published or not) under ``alg`` (default: the key type's)."""
        key = self._keys[kid]
        alg = alg or _DEFAULT_ALG[key.key_type]
        full_header: dict[str, Any] = {"alg": alg, **(header or {})}
        if include_kid:
            full_header.setdefault("kid", kid)
        with warnings.catch_warnings():
            # joserfc flags the EdDSA name as deprecated (RFC 9864); IdPs still use it.
            warnings.simplefilter("ignore", SecurityWarning)
            return jwt.encode(full_header, dict(claims), key, algorithms=[alg])

    # -- routes --------------------------------------------------------------

    async def _discovery(self, request: Request) -> Response:
        with self._lock:
            self.discovery_fetches += 1
            if self.fail_with is not None:
                return Response("unavailable", status_code=self.fail_with)
            document = {
                "issuer": self.issuer,
                "jwks_uri": f"{self.issuer}/jwks.json",
                "id_token_signing_alg_values_supported": ["RS256", "ES256", "EdDSA"],
                **self.discovery_overrides,
            }
        return JSONResponse(document)

    async def _jwks(self, request: Request) -> Response:
        with self._lock:
            self.jwks_fetches += 1
            fail_with, raw = self.fail_with, self.raw_jwks
        if fail_with is not None:
            return Response("unavailable", status_code=fail_with)
        if raw is not None:
            return Response(raw, media_type="application/json")
        return JSONResponse(self.jwks())


@contextmanager
def running_idp() -> Iterator[LoopbackIdP]:
    """A started IdP with one published key of each kind (RSA_KID, EC_KID, ED_KID)."""
    with LoopbackIdP() as server:
        server.add_key("RSA", kid=RSA_KID)
        server.add_key("EC", kid=EC_KID)
        server.add_key("OKP", kid=ED_KID)
        yield server
