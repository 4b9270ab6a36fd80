"""A trusted identity provider as configured: what it may sign with, and where its keys live.

Everything here is checked when the config is built (``ValueError``), so the
verifier never meets an issuer over plain http off loopback, a symmetric
algorithm, or a role map that names a role this service does not have.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from inferflux.policy.authn.bounds import TenantBounds

# Asymmetric algorithms only: with a JWKS published by a third party, a
# symmetric (HS*) algorithm would make the public key the shared secret.
# Each entry names the JWK type and curves that may verify it.
KEY_REQUIREMENTS: Mapping[str, tuple[str, frozenset[str] | None]] = MappingProxyType(
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
ALLOWED_ALGORITHMS: frozenset[str] = frozenset(KEY_REQUIREMENTS)
DEFAULT_ALGORITHMS: tuple[str, ...] = ("RS256", "ES256", "EdDSA")

ROLES: frozenset[str] = frozenset({"platform-admin", "tenant-admin", "member", "viewer"})
MAX_LEEWAY_SECONDS = 600

_LOOPBACK_NAMES = frozenset({"localhost"})


def _is_loopback_host(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_endpoint_url(url: str, what: str) -> None:
    """https only, except plain http on loopback (local development and tests); ValueError otherwise."""
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


def normalize_issuer(issuer: str) -> str:
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
        check_endpoint_url(self.issuer, "OIDC issuer")
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
            check_endpoint_url(self.jwks_uri, "OIDC jwks_uri")


def provider_config(record: Any) -> OidcProviderConfig:
    """The verifier's view of a stored OIDC provider (``policy.store``'s record)."""
    return OidcProviderConfig(
        id=record.id,
        name=record.name,
        issuer=record.issuer,
        audience=record.audience,
        algorithms=tuple(record.algorithms),
        tenant_claim=record.tenant_claim,
        roles_claim=record.roles_claim,
        role_map=dict(record.role_map or {}),
        required_claims=tuple(record.required_claims or ()),
        leeway_seconds=record.leeway_seconds,
        jwks_uri=record.jwks_uri,
        bounds=record.bounds(),
    )
