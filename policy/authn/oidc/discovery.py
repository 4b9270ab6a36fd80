"""Each provider's published keys: discovery, JWKS fetching, caching and how often the IdP is asked.

JWKS and discovery documents are cached per key source (issuer + ``jwks_uri``
override). An unknown ``kid`` triggers at most one refresh per
``min_refresh_interval`` per source, and concurrent requests share one
in-flight fetch, so a flood of tokens with made-up ``kid`` values cannot be
turned into a flood of requests to the IdP. A provider that cannot be reached
is an ``IdentityProviderUnavailable`` (503): retryable, unlike a 401 the
client could not fix. A cache belongs to one event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from inferflux.policy.authn.oidc.config import OidcProviderConfig, check_endpoint_url, normalize_issuer
from inferflux.policy.authn.oidc.parsing import ParsedToken
from inferflux.policy.authn.oidc.signing import Jwk, find_key, import_jwk
from inferflux.policy.errors import IdentityProviderUnavailable, InvalidToken

logger = logging.getLogger(__name__)

# Discovery documents and key sets are small; a larger answer is a broken or hostile IdP.
MAX_DOCUMENT_BYTES = 512 * 1024
MAX_JWKS_KEYS = 64

SourceKey = tuple[str, str | None]


@dataclass
class _KeySource:
    """Cached discovery and JWKS of one key source, plus its fetch bookkeeping."""

    jwks_uri: str | None = None
    discovered_at: float | None = None
    keys: tuple[Jwk, ...] | None = None
    fetched_at: float | None = None
    attempted_at: float | None = None
    failure: IdentityProviderUnavailable | None = None
    inflight: asyncio.Task[None] | None = None


def _source_key(provider: OidcProviderConfig) -> SourceKey:
    return (provider.issuer, provider.jwks_uri)


class KeyCache:
    """The keys of every configured key source, fetched on first use and kept for ``jwks_ttl``."""

    def __init__(
        self,
        *,
        http: httpx.AsyncClient | None,
        clock: Callable[[], float],
        jwks_ttl: float,
        min_refresh_interval: float,
        http_timeout: float,
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
        self._sources: dict[SourceKey, _KeySource] = {}

    def keep_only(self, providers: Iterable[OidcProviderConfig]) -> None:
        """Serve exactly these providers' key sources; cached keys of sources still in use are kept."""
        wanted = {_source_key(p) for p in providers}
        self._sources = {key: self._sources.get(key) or _KeySource() for key in wanted}

    async def aclose(self) -> None:
        for source in self._sources.values():
            if source.inflight is not None:
                source.inflight.cancel()
        if self._owns_http:
            await self._http.aclose()

    async def key_for(self, parsed: ParsedToken, provider: OidcProviderConfig) -> Jwk:
        """The provider's published key for this token; 401 ``unknown_key`` when it publishes none."""
        source = self._sources[_source_key(provider)]
        keys = await self._current_keys(provider, source)
        found = find_key(keys, parsed)
        # An unknown kid usually means the IdP rotated its keys since our last fetch. If that
        # refresh fails the answer is a retryable 503, not a 401 the client cannot fix.
        if found is None and await self._refresh_for_unknown_key(provider, source):
            found = find_key(source.keys or (), parsed)
        if found is None:
            raise InvalidToken("the token's signing key is not published by its issuer", code="unknown_key")
        return found

    # -- when to fetch -------------------------------------------------------

    async def _current_keys(self, provider: OidcProviderConfig, source: _KeySource) -> tuple[Jwk, ...]:
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

    # -- fetching ------------------------------------------------------------

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
            keys = _parse_jwks(document, provider)
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
        url = normalize_issuer(provider.issuer) + "/.well-known/openid-configuration"
        document = await self._get_json(url, provider, "discovery document", "invalid_discovery_document")
        source.jwks_uri = _check_discovery(document, provider)
        source.discovered_at = now
        return source.jwks_uri

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


# -- the documents ----------------------------------------------------------------


def _check_discovery(document: Any, provider: OidcProviderConfig) -> str:
    """The ``jwks_uri`` a discovery document names, once the document has proved to be this issuer's."""
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
        check_endpoint_url(jwks_uri, "jwks_uri")
    except ValueError as exc:
        raise IdentityProviderUnavailable(
            f"identity provider {provider.id!r} has an unusable discovery document: {exc}",
            code="invalid_discovery_document",
        ) from None
    return jwks_uri


def _parse_jwks(document: Any, provider: OidcProviderConfig) -> tuple[Jwk, ...]:
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise IdentityProviderUnavailable(
            f"identity provider {provider.id!r} served a JWKS without a 'keys' list", code="invalid_jwks"
        )
    keys = []
    for entry in document["keys"][:MAX_JWKS_KEYS]:
        jwk = import_jwk(entry, provider.id)
        if jwk is not None:
            keys.append(jwk)
    return tuple(keys)
