"""``OidcVerifier``: one bearer JWT through every check, in the order ``policy.authn.oidc`` describes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import httpx

from inferflux.policy.authn.bounds import TenantBounds
from inferflux.policy.authn.oidc.claims import (
    check_registered_claims,
    check_required_claims,
    map_groups,
    map_roles,
    map_tenant,
)
from inferflux.policy.authn.oidc.config import OidcProviderConfig
from inferflux.policy.authn.oidc.discovery import KeyCache
from inferflux.policy.authn.oidc.parsing import parse_token
from inferflux.policy.authn.oidc.routing import ProviderRoutes
from inferflux.policy.authn.oidc.signing import (
    check_algorithm_allowed,
    check_algorithm_for_provider,
    check_key_matches_algorithm,
    verify_signature,
)


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
        self._clock = clock
        self._routes = ProviderRoutes(providers)  # before the HTTP client: a bad list leaks none
        self._keys = KeyCache(
            http=http,
            clock=clock,
            jwks_ttl=jwks_ttl,
            min_refresh_interval=min_refresh_interval,
            http_timeout=http_timeout,
        )
        self._keys.keep_only(self._routes.providers())

    def set_providers(self, providers: Iterable[OidcProviderConfig]) -> None:
        """Replace the provider configs; cached keys of unchanged key sources are kept.

        Several providers may share an issuer (one IdP serving several tenants'
        applications) if their audiences differ: tokens are routed by both.
        """
        routes = ProviderRoutes(providers)
        self._keys.keep_only(routes.providers())
        self._routes = routes

    async def aclose(self) -> None:
        await self._keys.aclose()

    async def verify(self, token: str) -> VerifiedToken:
        parsed = parse_token(token)
        check_algorithm_allowed(parsed)
        provider = self._routes.select(parsed)
        check_algorithm_for_provider(parsed, provider)
        jwk = await self._keys.key_for(parsed, provider)
        check_key_matches_algorithm(parsed, jwk)
        verify_signature(parsed, jwk)
        claims = parsed.claims
        check_required_claims(claims, provider)
        check_registered_claims(claims, provider, self._clock())
        return VerifiedToken(
            provider_id=provider.id,
            bounds=provider.bounds,
            issuer=claims["iss"],
            subject=claims["sub"],
            tenant=map_tenant(claims, provider),
            roles=map_roles(claims, provider),
            groups=map_groups(claims, provider),
            claims=MappingProxyType(dict(claims)),
            expires_at=float(claims["exp"]),
        )
