"""Bearer-JWT verification against OpenID Connect identity providers.

An ``OidcVerifier`` serves any number of providers. A token is routed to its
provider by its (not yet verified) ``iss`` claim; from then on only that
provider's settings and keys are used, so one IdP can never vouch for another's
issuer.

The order of the checks is deliberate:

1. size and shape (three base64url parts, JSON objects) - cheap, and before any
   allocation proportional to the attacker's input;
2. ``alg`` against the global and the provider's allow-list - *before* any key
   is looked up, so ``none``, ``HS*`` and whatever else a library might accept
   never reach key material (the classic RSA-public-key-as-HMAC-secret attack);
3. the key by ``kid`` from the provider's JWKS, whose type must match the
   algorithm family;
4. the signature (joserfc, given exactly one algorithm);
5. the claims - only after the signature, so an unsigned payload cannot steer
   which error a caller sees.

Every failure is an ``InvalidToken`` (401) whose ``code`` names the rule; a
provider that cannot be reached is an ``IdentityProviderUnavailable`` (503).

JWKS and discovery documents are cached per key source (issuer + ``jwks_uri``
override). An unknown ``kid`` triggers at most one refresh per
``min_refresh_interval`` per provider, and concurrent requests share one
in-flight fetch, so a flood of tokens with made-up ``kid`` values cannot be
turned into a flood of requests to the IdP. A verifier belongs to one event
loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import httpx
from joserfc import jws
from joserfc.errors import (
    BadSignatureError,
    ExceededSizeError,
    InvalidKeyCurveError,
    InvalidKeyTypeError,
    JoseError,
    MissingCritHeaderError,
    UnsupportedAlgorithmError,
    UnsupportedHeaderError,
)
from joserfc.jwk import ECKey, JWKRegistry, Key, OKPKey, RSAKey
from joserfc.jws import JWSRegistry

from policy.authn.bounds import TenantBounds
from policy.errors import IdentityProviderUnavailable, InvalidToken

logger = logging.getLogger(__name__)

# Asymmetric algorithms only: with a JWKS published by a third party, a
# symmetric (HS*) algorithm would make the public key the shared secret.
# Each entry names the JWK type and curves that may verify it.
_KEY_REQUIREMENTS: Mapping[str, tuple[str, frozenset[str] | None]] = MappingProxyType(
    {
        "RS256": ("RSA", None),
        "RS384": ("RSA", None),
        "RS512": ("RSA", None),
        "PS256": ("RSA", None),
        "PS384": ("RSA", None),
        "PS512": ("RSA", None),
        "ES256": ("EC", frozenset({"P-256"})),
        "ES384": ("EC", frozenset({"P-384"})),
        "ES512": ("EC", frozenset({"P-521"})),
        "EdDSA": ("OKP", frozenset({"Ed25519", "Ed448"})),
        "Ed25519": ("OKP", frozenset({"Ed25519"})),
        "Ed448": ("OKP", frozenset({"Ed448"})),
    }
)
ALLOWED_ALGORITHMS: frozenset[str] = frozenset(_KEY_REQUIREMENTS)
DEFAULT_ALGORITHMS: tuple[str, ...] = ("RS256", "ES256", "EdDSA")

ROLES: frozenset[str] = frozenset({"platform-admin", "tenant-admin", "member", "viewer"})
ALWAYS_REQUIRED_CLAIMS: tuple[str, ...] = ("iss", "sub", "aud", "exp", "iat")

MAX_TOKEN_LENGTH = 16 * 1024
# Discovery documents and key sets are small; a larger answer is a broken or hostile IdP.
MAX_DOCUMENT_BYTES = 512 * 1024
MAX_JWKS_KEYS = 64
MIN_RSA_KEY_BITS = 2048
MAX_LEEWAY_SECONDS = 600

_B64URL = re.compile(r"^[A-Za-z0-9_-]*$")
_LOOPBACK_NAMES = frozenset({"localhost"})
# Members that make a JWK private. A verifier needs none of them, and keeping
# them would only widen what a leaked cache could expose.
_PRIVATE_JWK_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})


def _is_loopback_host(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_endpoint_url(url: str, what: str) -> None:
    """https only, except plain http on loopback (local development and tests)."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        raise ValueError(f"{what} {url!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{what} {url!r} must not carry credentials")
    if parts.scheme == "https":
        return
    if parts.scheme == "http" and _is_loopback_host(host):
        return
    if parts.scheme == "http":
        raise ValueError(f"{what} {url!r} must use https (plain http is accepted only for loopback hosts)")
    raise ValueError(f"{what} {url!r} must be an https URL")


def _normalize_issuer(issuer: str) -> str:
    # Only used to route a token and to tell "unknown issuer" from "almost our
    # issuer"; the final comparison is exact.
    return issuer.rstrip("/")


@dataclass(frozen=True)
class OidcProviderConfig:
    """One trusted identity provider, validated on construction (ValueError)."""

    id: str
    name: str
    issuer: str
    audience: str
    algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS
    tenant_claim: str = "tenant"
    roles_claim: str = "roles"
    role_map: Mapping[str, str] = field(default_factory=dict)
    groups_claim: str | None = "groups"
    required_claims: tuple[str, ...] = ()
    leeway_seconds: int = 30
    jwks_uri: str | None = None
    # Which tenants its tokens may sign users into; the verifier only carries it (the
    # authenticator, which knows tenants by id, enforces it). Default: none.
    bounds: TenantBounds = field(default_factory=TenantBounds)

    def __post_init__(self) -> None:
        # Normalize containers so that a config, once built, cannot change under the verifier.
        object.__setattr__(self, "algorithms", tuple(self.algorithms))
        object.__setattr__(self, "required_claims", tuple(self.required_claims))
        object.__setattr__(self, "role_map", MappingProxyType(dict(self.role_map)))
        self._validate_names()
        self._validate_issuer()
        self._validate_audience()
        self._validate_algorithms()
        self._validate_claim_paths()
        self._validate_role_map()
        self._validate_leeway()
        self._validate_jwks_uri()

    def _validate_names(self) -> None:
        for attr in ("id", "name"):
            value = getattr(self, attr)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"OIDC provider {attr} must be a non-empty string")

    def _validate_issuer(self) -> None:
        if not isinstance(self.issuer, str) or not self.issuer:
            raise ValueError("OIDC issuer must be a non-empty string")
        _check_endpoint_url(self.issuer, "OIDC issuer")
        parts = urlsplit(self.issuer)
        # OpenID Connect Discovery 1.0 section 3: no query or fragment in an issuer.
        if parts.query or parts.fragment:
            raise ValueError(f"OIDC issuer {self.issuer!r} must not have a query or fragment")

    def _validate_audience(self) -> None:
        if not isinstance(self.audience, str) or not self.audience:
            raise ValueError("OIDC audience must be a non-empty string")

    def _validate_algorithms(self) -> None:
        if not self.algorithms:
            raise ValueError("OIDC provider needs at least one algorithm")
        rejected = [alg for alg in self.algorithms if alg not in ALLOWED_ALGORITHMS]
        if rejected:
            raise ValueError(
                f"OIDC algorithms {rejected!r} are not allowed; choose from {sorted(ALLOWED_ALGORITHMS)!r} "
                "(symmetric algorithms and 'none' are never accepted)"
            )

    def _validate_claim_paths(self) -> None:
        for attr in ("tenant_claim", "roles_claim"):
            value = getattr(self, attr)
            if not isinstance(value, str) or not value:
                raise ValueError(f"OIDC {attr} must be a non-empty claim name or dotted path")
        if self.groups_claim is not None and (not isinstance(self.groups_claim, str) or not self.groups_claim):
            raise ValueError("OIDC groups_claim must be a non-empty claim name, or None")
        for claim in self.required_claims:
            if not isinstance(claim, str) or not claim:
                raise ValueError("OIDC required_claims must be non-empty claim names")

    def _validate_role_map(self) -> None:
        for source, role in self.role_map.items():
            if not isinstance(source, str) or role not in ROLES:
                raise ValueError(
                    f"OIDC role_map entry {source!r} -> {role!r}: the target must be one of {sorted(ROLES)}"
                )

    def _validate_leeway(self) -> None:
        if (
            isinstance(self.leeway_seconds, bool)
            or not isinstance(self.leeway_seconds, int)
            or not 0 <= self.leeway_seconds <= MAX_LEEWAY_SECONDS
        ):
            raise ValueError(f"OIDC leeway_seconds must be an integer from 0 to {MAX_LEEWAY_SECONDS}")

    def _validate_jwks_uri(self) -> None:
        if self.jwks_uri is not None:
            _check_endpoint_url(self.jwks_uri, "OIDC jwks_uri")


@dataclass(frozen=True)
class VerifiedToken:
    provider_id: str
    bounds: TenantBounds
    issuer: str
    subject: str
    tenant: str
    roles: tuple[str, ...]
    groups: tuple[str, ...]
    claims: Mapping[str, Any]
    expires_at: float


@dataclass(frozen=True)
class _ParsedToken:
    raw: str
    header: Mapping[str, Any]
    claims: Mapping[str, Any]

    @property
    def alg(self) -> str:
        return self.header["alg"]

    @property
    def kid(self) -> str | None:
        return self.header.get("kid")


@dataclass(frozen=True)
class _Jwk:
    kid: str | None
    alg: str | None  # the JWK's own "alg" member, if it pins one
    kty: str
    crv: str | None
    key: Key


@dataclass
class _KeySource:
    """Cached discovery and JWKS of one key source, plus its fetch bookkeeping."""

    jwks_uri: str | None = None
    discovered_at: float | None = None
    keys: tuple[_Jwk, ...] | None = None
    fetched_at: float | None = None
    attempted_at: float | None = None
    failure: IdentityProviderUnavailable | None = None
    inflight: asyncio.Task[None] | None = None


class _JWSRegistry(JWSRegistry):
    """A registry that accepts exactly the algorithms it is built with.

    joserfc warns on every use of ``EdDSA`` (renamed by RFC 9864) while it is
    still what most IdPs publish; the allow-list is ours, so the warning is
    only noise here. Headers may be a little larger than joserfc's default to
    fit IdPs that add certificate thumbprints.
    """

    max_header_length = 4096

    def get_alg(self, name: str) -> Any:
        if not self.allowed or name not in self.allowed or name not in self.algorithms:
            raise UnsupportedAlgorithmError(f"Algorithm of '{name}' is not allowed")
        return self.algorithms[name]


def _b64url_decode(segment: str) -> bytes:
    if not _B64URL.match(segment) or len(segment) % 4 == 1:
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two parsers reading different values for one claim is how claim
    # smuggling starts; a duplicate member makes the token malformed.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate member {key!r}")
        result[key] = value
    return result


def _json_object(data: bytes) -> dict[str, Any]:
    value = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _claim_at(claims: Mapping[str, Any], path: str) -> Any:
    """The value at ``path``: an exact claim name first, so namespaced claims
    such as ``https://example.com/tenant`` work, then a dotted path into
    nested objects. None when absent."""
    if path in claims:
        return claims[path]
    value: Any = claims
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _string_list(value: Any) -> list[str]:
    """A list claim, given as a JSON array or a space-separated string; anything else counts as empty."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [item for item in value if isinstance(item, str) and item]
    return []


def _dedupe(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(values))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class OidcVerifier:
    """Validates tokens of one or more providers; picks the provider by the token's (unverified) iss."""

    def __init__(
        self,
        providers: Iterable[OidcProviderConfig],
        *,
        http: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.time,
        jwks_ttl: float = 3600,
        min_refresh_interval: float = 30,
        http_timeout: float = 5.0,
    ) -> None:
        if jwks_ttl <= 0 or min_refresh_interval < 0 or http_timeout <= 0:
            raise ValueError("jwks_ttl and http_timeout must be positive, min_refresh_interval not negative")
        self._owns_http = http is None
        # No redirects: the discovery document and jwks_uri are the IdP's word
        # on where its keys live; following a redirect would let anyone who
        # controls a redirect choose our keys.
        self._http = http if http is not None else httpx.AsyncClient(timeout=http_timeout, follow_redirects=False)
        self._clock = clock
        self._jwks_ttl = jwks_ttl
        self._min_refresh_interval = min_refresh_interval
        self._http_timeout = http_timeout
        self._providers: dict[str, list[OidcProviderConfig]] = {}
        self._sources: dict[tuple[str, str | None], _KeySource] = {}
        self.set_providers(providers)

    # -- configuration -----------------------------------------------------

    def set_providers(self, providers: Iterable[OidcProviderConfig]) -> None:
        """Replace the provider configs; cached keys of unchanged key sources are kept.

        Several providers may share an issuer (one IdP serving several tenants'
        applications) if their audiences differ: tokens are routed by both.
        """
        by_issuer: dict[str, list[OidcProviderConfig]] = {}
        for provider in providers:
            if not isinstance(provider, OidcProviderConfig):
                raise TypeError(f"expected OidcProviderConfig, got {type(provider).__name__}")
            same_issuer = by_issuer.setdefault(_normalize_issuer(provider.issuer), [])
            twin = next((p for p in same_issuer if p.audience == provider.audience), None)
            if twin is not None:
                raise ValueError(
                    f"OIDC providers {twin.id!r} and {provider.id!r} share issuer {provider.issuer!r} "
                    f"and audience {provider.audience!r}"
                )
            same_issuer.append(provider)
        wanted = {self._source_key(p) for group in by_issuer.values() for p in group}
        self._sources = {key: self._sources.get(key) or _KeySource() for key in wanted}
        self._providers = by_issuer

    @staticmethod
    def _source_key(provider: OidcProviderConfig) -> tuple[str, str | None]:
        return (provider.issuer, provider.jwks_uri)

    async def aclose(self) -> None:
        for source in self._sources.values():
            if source.inflight is not None:
                source.inflight.cancel()
        if self._owns_http:
            await self._http.aclose()

    # -- verification ------------------------------------------------------

    async def verify(self, token: str) -> VerifiedToken:
        self._check_size(token)
        parsed = self._parse(token)
        self._check_algorithm_allowed(parsed)
        provider = self._select_provider(parsed)
        self._check_algorithm_for_provider(parsed, provider)
        jwk = await self._resolve_key(parsed, provider)
        self._check_key_matches_algorithm(parsed, jwk)
        self._verify_signature(parsed, jwk)
        claims = parsed.claims
        self._check_required_claims(claims, provider)
        self._check_issuer(claims, provider)
        self._check_audience(claims, provider)
        self._check_subject(claims)
        now = self._clock()
        self._check_expiry(claims, provider, now)
        self._check_not_before(claims, provider, now)
        self._check_issued_at(claims, provider, now)
        return VerifiedToken(
            provider_id=provider.id,
            bounds=provider.bounds,
            issuer=claims["iss"],
            subject=claims["sub"],
            tenant=self._tenant(claims, provider),
            roles=self._roles(claims, provider),
            groups=self._groups(claims, provider),
            claims=MappingProxyType(dict(claims)),
            expires_at=float(claims["exp"]),
        )

    # -- shape ---------------------------------------------------------------

    def _check_size(self, token: Any) -> None:
        if not isinstance(token, str) or not token:
            raise InvalidToken("the bearer token is empty or not text", code="malformed_token")
        if len(token) > MAX_TOKEN_LENGTH:
            raise InvalidToken(f"the bearer token is longer than {MAX_TOKEN_LENGTH} characters", code="malformed_token")

    def _parse(self, token: str) -> _ParsedToken:
        parts = token.split(".")
        if len(parts) != 3:
            raise InvalidToken("a JWT has three dot-separated parts", code="malformed_token")
        try:
            header = _json_object(_b64url_decode(parts[0]))
            claims = _json_object(_b64url_decode(parts[1]))
            _b64url_decode(parts[2])
        except (ValueError, UnicodeDecodeError, binascii.Error, RecursionError):
            raise InvalidToken("the JWT is not base64url-encoded JSON", code="malformed_token") from None
        if not isinstance(header.get("alg"), str):
            raise InvalidToken("the JWT header has no 'alg'", code="malformed_token")
        if "kid" in header and not isinstance(header["kid"], str):
            raise InvalidToken("the JWT header's 'kid' is not a string", code="malformed_token")
        return _ParsedToken(raw=token, header=header, claims=claims)

    # -- algorithm -----------------------------------------------------------

    def _check_algorithm_allowed(self, parsed: _ParsedToken) -> None:
        # Before the issuer is even looked at: 'none' and HS* are refused for everyone.
        if parsed.alg not in ALLOWED_ALGORITHMS:
            raise InvalidToken(f"algorithm {parsed.alg!r} is not accepted", code="unsupported_algorithm")

    def _check_algorithm_for_provider(self, parsed: _ParsedToken, provider: OidcProviderConfig) -> None:
        if parsed.alg not in provider.algorithms:
            raise InvalidToken(
                f"algorithm {parsed.alg!r} is not accepted for provider {provider.id!r}", code="unsupported_algorithm"
            )

    # -- issuer --------------------------------------------------------------

    def _select_provider(self, parsed: _ParsedToken) -> OidcProviderConfig:
        issuer = parsed.claims.get("iss")
        if issuer is None:
            raise InvalidToken("the token has no 'iss' claim", code="missing_claim")
        if not isinstance(issuer, str):
            raise InvalidToken("the token's 'iss' claim is not a string", code="invalid_issuer")
        candidates = self._providers.get(_normalize_issuer(issuer))
        if not candidates:
            raise InvalidToken("the token's issuer is not a trusted identity provider", code="unknown_issuer")
        if len(candidates) == 1:
            return candidates[0]  # its audience is checked with the other claims
        return self._select_by_audience(parsed, candidates)

    def _select_by_audience(self, parsed: _ParsedToken, candidates: list[OidcProviderConfig]) -> OidcProviderConfig:
        """One issuer, several providers: the token's (not yet verified) ``aud`` picks one.

        Safe before the signature: every candidate trusts the same issuer's keys, and the
        audience is checked again after it. A token addressed to two of them is refused,
        not given to either: which tenant it enters must not be the token's choice.
        """
        audience = parsed.claims.get("aud")
        named = [audience] if isinstance(audience, str) else audience if isinstance(audience, list) else []
        audiences = {a for a in named if isinstance(a, str)}
        matching = [p for p in candidates if p.audience in audiences]
        if not matching:
            raise InvalidToken("the token is not meant for this service", code="invalid_audience")
        if len(matching) > 1:
            raise InvalidToken(
                "the token is addressed to several identity providers here; it must name one audience",
                code="ambiguous_audience",
            )
        return matching[0]

    def _check_issuer(self, claims: Mapping[str, Any], provider: OidcProviderConfig) -> None:
        # Routing tolerated a trailing slash; the issuer itself must match exactly (OIDC Core 3.1.3.7).
        if claims["iss"] != provider.issuer:
            raise InvalidToken(f"the token's issuer does not match {provider.issuer!r}", code="invalid_issuer")

    # -- keys ----------------------------------------------------------------

    async def _resolve_key(self, parsed: _ParsedToken, provider: OidcProviderConfig) -> _Jwk:
        source = self._sources[self._source_key(provider)]
        keys = await self._current_keys(provider, source)
        found = self._find_key(keys, parsed)
        # An unknown kid usually means the IdP rotated its keys since our last fetch. If that
        # refresh fails the answer is a retryable 503, not a 401 the client cannot fix.
        if found is None and await self._refresh_for_unknown_key(provider, source):
            found = self._find_key(source.keys or (), parsed)
        if found is None:
            raise InvalidToken("the token's signing key is not published by its issuer", code="unknown_key")
        return found

    def _find_key(self, keys: Iterable[_Jwk], parsed: _ParsedToken) -> _Jwk | None:
        kid = parsed.kid
        if kid is not None:
            candidates = [jwk for jwk in keys if jwk.kid == kid]
            # One kid may name keys of several types; prefer the one that fits the algorithm.
            fitting = [jwk for jwk in candidates if self._key_fits(jwk, parsed.alg)]
            return (fitting or candidates or [None])[0]
        # Without a kid a key can be chosen only if exactly one fits.
        fitting = [jwk for jwk in keys if self._key_fits(jwk, parsed.alg)]
        return fitting[0] if len(fitting) == 1 else None

    @staticmethod
    def _key_fits(jwk: _Jwk, alg: str) -> bool:
        requirement = _KEY_REQUIREMENTS.get(alg)
        if requirement is None:
            return False
        kty, curves = requirement
        if jwk.kty != kty or (curves is not None and jwk.crv not in curves):
            return False
        return jwk.alg is None or jwk.alg == alg

    def _check_key_matches_algorithm(self, parsed: _ParsedToken, jwk: _Jwk) -> None:
        if not self._key_fits(jwk, parsed.alg):
            raise InvalidToken(
                f"key {jwk.kid!r} ({jwk.kty}) cannot verify algorithm {parsed.alg!r}", code="key_type_mismatch"
            )

    def _verify_signature(self, parsed: _ParsedToken, jwk: _Jwk) -> None:
        # Exactly one algorithm, already checked against both allow-lists and the key's type.
        registry = _JWSRegistry(algorithms=(parsed.alg,), strict_check_header=False)
        try:
            jws.deserialize_compact(parsed.raw, jwk.key, registry=registry)
        except BadSignatureError:
            raise InvalidToken("the token's signature is not valid", code="invalid_signature") from None
        except UnsupportedAlgorithmError:
            raise InvalidToken(f"algorithm {parsed.alg!r} is not accepted", code="unsupported_algorithm") from None
        except (InvalidKeyTypeError, InvalidKeyCurveError):
            raise InvalidToken("the signing key cannot verify this algorithm", code="key_type_mismatch") from None
        except (ExceededSizeError, MissingCritHeaderError, UnsupportedHeaderError):
            raise InvalidToken("the JWT header is not acceptable", code="malformed_token") from None
        except (JoseError, ValueError, TypeError, KeyError):
            # Whatever else the JOSE layer dislikes (odd header values, a
            # signature of the wrong length) is still a token we cannot trust.
            raise InvalidToken("the token's signature is not valid", code="invalid_signature") from None

    # -- claims --------------------------------------------------------------

    def _check_required_claims(self, claims: Mapping[str, Any], provider: OidcProviderConfig) -> None:
        for name in (*ALWAYS_REQUIRED_CLAIMS, *provider.required_claims):
            if _claim_at(claims, name) is None:
                raise InvalidToken(f"the token has no {name!r} claim", code="missing_claim")

    def _check_audience(self, claims: Mapping[str, Any], provider: OidcProviderConfig) -> None:
        audience = claims["aud"]
        if isinstance(audience, str):
            accepted = audience == provider.audience
        elif isinstance(audience, list) and all(isinstance(item, str) for item in audience):
            accepted = provider.audience in audience
        else:
            accepted = False
        if not accepted:
            raise InvalidToken("the token is not meant for this service", code="invalid_audience")

    def _check_subject(self, claims: Mapping[str, Any]) -> None:
        if not isinstance(claims["sub"], str) or not claims["sub"]:
            raise InvalidToken("the token's 'sub' claim is not a non-empty string", code="invalid_claim")

    def _time_claim(self, claims: Mapping[str, Any], name: str) -> float | None:
        value = claims.get(name)
        if value is None:
            return None
        if not _is_number(value):
            raise InvalidToken(f"the token's {name!r} claim is not a number", code="invalid_claim")
        return float(value)

    def _check_expiry(self, claims: Mapping[str, Any], provider: OidcProviderConfig, now: float) -> None:
        expires = self._time_claim(claims, "exp")
        if expires is not None and now >= expires + provider.leeway_seconds:
            raise InvalidToken("the token has expired", code="token_expired")

    def _check_not_before(self, claims: Mapping[str, Any], provider: OidcProviderConfig, now: float) -> None:
        not_before = self._time_claim(claims, "nbf")
        if not_before is not None and now + provider.leeway_seconds < not_before:
            raise InvalidToken("the token is not valid yet", code="token_not_yet_valid")

    def _check_issued_at(self, claims: Mapping[str, Any], provider: OidcProviderConfig, now: float) -> None:
        issued = self._time_claim(claims, "iat")
        if issued is not None and now + provider.leeway_seconds < issued:
            raise InvalidToken("the token was issued in the future", code="token_issued_in_future")

    def _tenant(self, claims: Mapping[str, Any], provider: OidcProviderConfig) -> str:
        tenant = _claim_at(claims, provider.tenant_claim)
        if tenant is None or tenant == "":
            raise InvalidToken(f"the token has no {provider.tenant_claim!r} claim", code="missing_tenant_claim")
        if not isinstance(tenant, str):
            raise InvalidToken(
                f"the token's {provider.tenant_claim!r} claim is not a string", code="invalid_tenant_claim"
            )
        return tenant

    def _roles(self, claims: Mapping[str, Any], provider: OidcProviderConfig) -> tuple[str, ...]:
        # Unmapped values are dropped: an IdP's role vocabulary grants nothing here unless configured.
        values = _string_list(_claim_at(claims, provider.roles_claim))
        return _dedupe(provider.role_map[v] for v in values if v in provider.role_map)

    def _groups(self, claims: Mapping[str, Any], provider: OidcProviderConfig) -> tuple[str, ...]:
        if provider.groups_claim is None:
            return ()
        return _dedupe(_string_list(_claim_at(claims, provider.groups_claim)))

    # -- fetching and caching ------------------------------------------------

    async def _current_keys(self, provider: OidcProviderConfig, source: _KeySource) -> tuple[_Jwk, ...]:
        if source.keys is None:
            if source.inflight is None and self._recently_failed(source) and source.failure is not None:
                # Negative caching: a down IdP is asked again only once per interval, not once per request.
                raise IdentityProviderUnavailable(source.failure.message, code=source.failure.code)
            await self._fetch_shared(provider, source)
        elif self._is_stale(source) and self._may_fetch(source):
            try:
                await self._fetch_shared(provider, source)
            except IdentityProviderUnavailable as exc:
                # Keys rotate rarely and overlap; stale keys beat failing every request while the IdP is down.
                logger.warning(
                    "OIDC provider %s: keeping cached keys after refresh failed: %s", provider.id, exc.message
                )
        if source.keys is None:
            raise IdentityProviderUnavailable(f"no keys for identity provider {provider.id!r}")
        return source.keys

    async def _refresh_for_unknown_key(self, provider: OidcProviderConfig, source: _KeySource) -> bool:
        """Refresh once for a kid we do not know (key rotation); False when rate-limited."""
        if not self._may_fetch(source):
            return False
        await self._fetch_shared(provider, source)
        return True

    def _is_stale(self, source: _KeySource) -> bool:
        return source.fetched_at is None or self._clock() - source.fetched_at >= self._jwks_ttl

    def _may_fetch(self, source: _KeySource) -> bool:
        # Joining a fetch already under way costs the IdP nothing.
        if source.inflight is not None:
            return True
        return source.attempted_at is None or self._clock() - source.attempted_at >= self._min_refresh_interval

    def _recently_failed(self, source: _KeySource) -> bool:
        return source.failure is not None and not self._may_fetch(source)

    async def _fetch_shared(self, provider: OidcProviderConfig, source: _KeySource) -> None:
        """Fetch keys, or wait for the fetch already under way for this source."""
        task = source.inflight
        if task is None:
            task = asyncio.get_running_loop().create_task(self._fetch_keys(provider, source))
            # A fetch whose waiters were all cancelled must not log "exception never retrieved".
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            source.inflight = task
        # Shielded: one cancelled request must not cancel the fetch others are waiting for.
        await asyncio.shield(task)

    async def _fetch_keys(self, provider: OidcProviderConfig, source: _KeySource) -> None:
        source.attempted_at = self._clock()
        try:
            jwks_uri = await self._jwks_uri(provider, source)
            document = await self._get_json(jwks_uri, provider, "JWKS", "invalid_jwks")
            keys = self._parse_jwks(document, provider)
        except IdentityProviderUnavailable as exc:
            source.failure = exc
            # The jwks_uri may have moved; ask discovery again next time.
            source.discovered_at = None
            raise
        finally:
            source.inflight = None
        source.keys = keys
        source.fetched_at = self._clock()
        source.failure = None

    async def _jwks_uri(self, provider: OidcProviderConfig, source: _KeySource) -> str:
        if provider.jwks_uri is not None:
            return provider.jwks_uri
        now = self._clock()
        fresh = source.discovered_at is not None and now - source.discovered_at < self._jwks_ttl
        if source.jwks_uri is not None and fresh:
            return source.jwks_uri
        url = _normalize_issuer(provider.issuer) + "/.well-known/openid-configuration"
        document = await self._get_json(url, provider, "discovery document", "invalid_discovery_document")
        source.jwks_uri = self._check_discovery(document, provider)
        source.discovered_at = now
        return source.jwks_uri

    def _check_discovery(self, document: Any, provider: OidcProviderConfig) -> str:
        if not isinstance(document, dict):
            raise IdentityProviderUnavailable(
                f"identity provider {provider.id!r} served a discovery document that is not a JSON object",
                code="invalid_discovery_document",
            )
        # OIDC Discovery 4.3: the document must name exactly the issuer we asked; anything else is a mix-up.
        if document.get("issuer") != provider.issuer:
            raise IdentityProviderUnavailable(
                f"identity provider {provider.id!r} announces issuer {document.get('issuer')!r}, "
                f"not {provider.issuer!r}",
                code="issuer_mismatch",
            )
        jwks_uri = document.get("jwks_uri")
        try:
            if not isinstance(jwks_uri, str):
                raise ValueError("jwks_uri is missing")
            _check_endpoint_url(jwks_uri, "jwks_uri")
        except ValueError as exc:
            raise IdentityProviderUnavailable(
                f"identity provider {provider.id!r} has an unusable discovery document: {exc}",
                code="invalid_discovery_document",
            ) from None
        return jwks_uri

    async def _get_json(self, url: str, provider: OidcProviderConfig, what: str, invalid_code: str) -> Any:
        body = bytearray()
        try:
            async with self._http.stream(
                "GET",
                url,
                headers={"accept": "application/json"},
                timeout=self._http_timeout,
                follow_redirects=False,  # also when the caller's client would follow them
            ) as response:
                if response.status_code != 200:
                    raise IdentityProviderUnavailable(
                        f"identity provider {provider.id!r} answered {response.status_code} for its {what}"
                    )
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_DOCUMENT_BYTES:
                        raise IdentityProviderUnavailable(f"identity provider {provider.id!r} sent an oversized {what}")
        except httpx.HTTPError as exc:
            raise IdentityProviderUnavailable(
                f"identity provider {provider.id!r} cannot be reached for its {what}: {type(exc).__name__}"
            ) from None
        try:
            return json.loads(bytes(body))
        except (ValueError, RecursionError):
            raise IdentityProviderUnavailable(
                f"identity provider {provider.id!r} sent a {what} that is not JSON", code=invalid_code
            ) from None

    def _parse_jwks(self, document: Any, provider: OidcProviderConfig) -> tuple[_Jwk, ...]:
        if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
            raise IdentityProviderUnavailable(
                f"identity provider {provider.id!r} served a JWKS without a 'keys' list", code="invalid_jwks"
            )
        keys = []
        for entry in document["keys"][:MAX_JWKS_KEYS]:
            jwk = self._import_jwk(entry, provider)
            if jwk is not None:
                keys.append(jwk)
        return tuple(keys)

    def _import_jwk(self, entry: Any, provider: OidcProviderConfig) -> _Jwk | None:
        """One published key, or None (logged) when it cannot be used to verify signatures.

        A single odd key (an encryption key, an unknown type) must not make
        the provider's other keys unusable, so keys are judged one by one.
        """
        if not isinstance(entry, dict):
            return None
        kty, kid, alg = entry.get("kty"), entry.get("kid"), entry.get("alg")
        if kty not in ("RSA", "EC", "OKP") or not isinstance(kid, str | None) or not isinstance(alg, str | None):
            return None
        if entry.get("use", "sig") != "sig":
            return None
        key_ops = entry.get("key_ops")
        if key_ops is not None and (not isinstance(key_ops, list) or "verify" not in key_ops):
            return None
        public = {name: value for name, value in entry.items() if name not in _PRIVATE_JWK_MEMBERS}
        try:
            key = JWKRegistry.import_key(public)
        except Exception as exc:  # noqa: BLE001 - untrusted input; any import failure means "skip this key"
            logger.warning("OIDC provider %s: ignoring unusable JWK %r: %s", provider.id, kid, exc)
            return None
        if isinstance(key, RSAKey) and key.public_key.key_size < MIN_RSA_KEY_BITS:
            logger.warning(
                "OIDC provider %s: ignoring RSA key %r shorter than %d bits", provider.id, kid, MIN_RSA_KEY_BITS
            )
            return None
        crv = key.curve_name if isinstance(key, (ECKey, OKPKey)) else None
        return _Jwk(kid=kid, alg=alg, kty=kty, crv=crv, key=key)
