"""Authentication on every request: API keys and OIDC bearer JWTs.

``AuthMiddleware`` (pure ASGI) turns the request's credentials into a
``Principal`` on the request context, or answers 401 itself. What a principal
may do is checked by the routes (``gateway.authz.requires``).

Decisions are cached in-process, because the store is a database round trip
away. Two things bound how long a cached decision may outlive a change in the
store (a key revoked, a role changed, a tenant disabled):

* every write to the store bumps its ``policy_version``; a background task
  polls it (``auth.revocation_poll_seconds``, default 1 s) and, when it moves,
  has every cached decision read again before it is used, so every replica
  sees a change within about one poll interval (the old decision stays only as
  the snapshot served while the store cannot be read: ``policy.snapshot``; one
  the store refused is dropped);
* no entry lives longer than ``auth.cache_ttl_seconds`` or past the expiry of
  the key or token it was made from.

The last-used time of API keys is collected in memory and written in batches
off the request path. Which credential a request presents, and the cache its
decisions are kept in, are ``policy.authn.credentials``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from inferflux.gateway.context import get_context
from inferflux.gateway.errors import render_error
from inferflux.gateway.tracing import stage
from inferflux.policy.authn.apikeys import looks_like_key
from inferflux.policy.authn.credentials import CredentialCache, credential_digest, presented_credential
from inferflux.policy.authn.oidc import OidcVerifier, VerifiedToken
from inferflux.policy.authn.oidc.config import provider_config
from inferflux.policy.errors import (
    AuthenticationError,
    InvalidApiKey,
    InvalidToken,
    NotFound,
    PermissionDenied,
    PolicyError,
    StoreUnavailable,
)
from inferflux.policy.rbac import Principal, Role, effective_models
from inferflux.policy.snapshot import StoreSnapshot
from inferflux.policy.store import PolicyStore, TenantRecord

log = logging.getLogger("inferflux.gateway.auth")

T = TypeVar("T")

# Routes that answer without credentials: probes and the scrape endpoint.
PUBLIC_PATHS = frozenset({"/livez", "/readyz", "/metrics"})

# The web console (gateway.console) authenticates its own requests, by a session cookie.
CONSOLE_PREFIX = "/console"

# The tenant whose principals may hold platform-admin (created at bootstrap).
PLATFORM_TENANT = "platform"


async def call_store(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a store call on the thread pool; a database failure becomes a 503, never a 500."""
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except PolicyError:
        raise
    except Exception as exc:  # the driver's errors: connection refused, timeouts, ...
        from sqlalchemy.exc import SQLAlchemyError

        if not isinstance(exc, SQLAlchemyError):
            raise
        log.error("policy store call %s failed: %s", getattr(fn, "__name__", fn), exc)
        raise StoreUnavailable("The policy store is unavailable; retry shortly") from None


def _epoch(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


class Authenticator:
    def __init__(
        self,
        store: PolicyStore,
        verifier: OidcVerifier | None = None,
        *,
        cache_ttl: float = 30.0,
        negative_ttl: float = 2.0,
        poll_interval: float = 1.0,
        flush_interval: float = 5.0,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        snapshot: StoreSnapshot | None = None,
    ) -> None:
        self.store = store
        # Shared with the limit and guardrail resolvers: how old the cached decisions are.
        self.snapshot = snapshot if snapshot is not None else StoreSnapshot()
        self.verifier = verifier if verifier is not None else OidcVerifier(())
        self.cache_ttl = cache_ttl
        self.negative_ttl = negative_ttl
        self.poll_interval = poll_interval
        self.flush_interval = flush_interval
        self._clock = clock
        self._wall = wall_clock
        self._cache = CredentialCache(max_entries, clock)
        self._rejected = CredentialCache(max_entries, clock)
        self._version: int | None = None
        # Bumped whenever the caches are dropped; a decision made from reads
        # that began before a bump may predate the change and is not cached.
        self._generation = 0
        self._last_used: dict[str, datetime] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._watchers: list[Callable[[int], None]] = []

    # -- lifecycle

    async def start(self) -> None:
        """Load the identity providers and start the background pollers."""
        await self.refresh(force=True)
        self._tasks = [
            asyncio.create_task(self._every(self.poll_interval, self.refresh), name="auth-policy-poll"),
            asyncio.create_task(self._every(self.flush_interval, self.flush_last_used), name="auth-last-used"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        await self.flush_last_used()
        await self.verifier.aclose()

    async def _every(self, interval: float, fn: Callable[[], Awaitable[Any]]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception as exc:  # keep polling; the next round may succeed
                log.warning("background %s failed: %s", getattr(fn, "__name__", fn), exc)

    def on_version(self, watcher: Callable[[int], None]) -> None:
        """Call ``watcher`` with every ``policy_version`` this poller reads (the limit and guardrail
        resolvers take it as their own poll: one store read per interval for all three, none in a request)."""
        self._watchers.append(watcher)

    async def refresh(self, force: bool = False) -> bool:
        """Drop cached decisions if the store changed since the last look; True if it did."""
        try:
            version = await call_store(self.store.policy_version)
        except StoreUnavailable:
            self.snapshot.failed()
            raise
        self.snapshot.fresh()
        for watcher in self._watchers:
            try:
                watcher(version)
            except Exception:  # a watcher's bug must not stop revocations reaching this replica
                log.exception("a policy_version watcher failed")
        if not force and version == self._version:
            return False
        try:
            providers = await call_store(self.store.list_enabled_oidc_providers)
            self.verifier.set_providers([provider_config(p) for p in providers])
        finally:
            # After the providers are in place (no await between): a token
            # verified meanwhile against the old ones is not cached. Decisions are
            # read again, but kept as the snapshot until they are: a store that goes
            # away right after a write elsewhere must not take every warm key with it.
            self._cache.expire_all()
            self._rejected.clear()
            self._generation += 1
        self._version = version
        return True

    async def flush_last_used(self) -> None:
        if not self._last_used:
            return
        batch, self._last_used = self._last_used, {}
        try:
            await call_store(self.store.touch_api_keys, batch)
        except PolicyError as exc:  # best effort: a lost last-used time is not worth a failed request
            log.warning("could not record API key use: %s", exc.message)

    # -- authentication

    async def authenticate(self, authorization: str | None, api_key: str | None) -> Principal:
        token = presented_credential(authorization, api_key)
        digest = credential_digest(token)
        principal = self._cache.get(digest)
        if principal is not None and self._unexpired(principal):
            if self.snapshot.expired:  # even a fresh entry: nothing from the store is trusted past the window
                raise StoreUnavailable("The policy store has been unavailable too long; retry shortly")
            self._note_use(principal)
            return principal
        rejected = self._rejected.get(digest)
        if rejected is not None:
            raise rejected
        generation = self._generation
        try:
            if looks_like_key(token):
                principal = await self._from_api_key(token)
            elif token.count(".") == 2:
                principal = await self._from_jwt(token)
            else:
                raise AuthenticationError("The credential is neither an API key nor a JWT", code="invalid_credentials")
        except StoreUnavailable:
            return self._from_snapshot(digest)
        except (AuthenticationError, PermissionDenied) as exc:
            self._cache.discard(digest)  # refused now: never served again from the snapshot
            if generation == self._generation:
                self._rejected.put(digest, exc, self.negative_ttl)
            raise
        # The store changed while this request read it (a key revoked, a role
        # removed): the decision stands for this request but must not be
        # cached past the change, or it would outlive the revocation bound.
        if generation == self._generation:
            self._cache.put(digest, principal, self._ttl(principal))
        self._note_use(principal)
        return principal

    def _unexpired(self, principal: Principal) -> bool:
        return principal.expires_at is None or principal.expires_at > self._wall()

    def _from_snapshot(self, digest: bytes) -> Principal:
        """The store is unreachable: the last decision it allowed for this credential, within the stale window.

        A credential never seen (or refused) has no snapshot and gets the 503.
        """
        self.snapshot.failed()
        principal = self._cache.stale(digest)
        if principal is None or not self._unexpired(principal) or not self.snapshot.may_serve_stale():
            raise StoreUnavailable("The policy store is unavailable; retry shortly")
        self._note_use(principal)
        return principal

    def _ttl(self, principal: Principal) -> float:
        ttl = self.cache_ttl
        if principal.expires_at is not None:
            ttl = min(ttl, principal.expires_at - self._wall())
        return ttl

    def _note_use(self, principal: Principal) -> None:
        if principal.key_id is not None:
            self._last_used[principal.key_id] = datetime.now(UTC)

    async def _from_api_key(self, token: str) -> Principal:
        key = await call_store(self.store.find_api_key, token)
        if key is None:
            raise InvalidApiKey("Invalid, expired or revoked API key")
        tenant = await call_store(self.store.get_tenant, key.tenant_id)
        roles = frozenset({key.role})
        if Role.PLATFORM_ADMIN in roles and tenant.name != PLATFORM_TENANT:
            roles = frozenset()  # never granted outside the platform tenant, whatever the row says
        if not roles:
            raise InvalidApiKey("This API key grants no role")
        return Principal(
            tenant_id=tenant.id,
            tenant_name=tenant.name,
            subject=f"key:{key.prefix}",
            kind="api_key",
            roles=roles,
            key_id=key.id,
            allowed_models=effective_models(tenant.allowed_models, key.allowed_models),
            expires_at=_epoch(key.expires_at),
        )

    async def _from_jwt(self, token: str) -> Principal:
        verified: VerifiedToken = await self.verifier.verify(token)
        tenant = await self._token_tenant(verified)
        if tenant.disabled:
            raise InvalidToken(f"The tenant '{tenant.name}' is disabled", code="tenant_disabled")
        bound = await call_store(
            self.store.find_role_bindings, verified.provider_id, tenant.id, verified.subject, list(verified.groups)
        )
        roles = set(verified.roles) | set(bound)
        if tenant.name != PLATFORM_TENANT or not verified.bounds.grants_platform_admin:
            roles.discard(Role.PLATFORM_ADMIN.value)
        if not roles:
            raise PermissionDenied(
                "The token is valid but grants no role in this tenant; ask an admin for a role binding", code="no_role"
            )
        return Principal(
            tenant_id=tenant.id,
            tenant_name=tenant.name,
            subject=f"oidc:{verified.provider_id}:{verified.subject}",
            kind="oidc",
            roles=frozenset(roles),
            allowed_models=effective_models(tenant.allowed_models),
            expires_at=verified.expires_at,
        )

    async def _token_tenant(self, verified: VerifiedToken) -> TenantRecord:
        """The token's tenant, if its identity provider may sign users into it.

        A tenant that does not exist and one the provider may not map into get
        the same answer, so an IdP's administrator cannot probe for tenant names.
        """
        refused = InvalidToken(
            f"The token's tenant '{verified.tenant}' does not exist or is not one its identity provider "
            "may sign users into",
            code="tenant_not_allowed",
        )
        try:
            tenant = await call_store(self.store.get_tenant_by_name, verified.tenant)
        except NotFound:
            raise refused from None
        if not verified.bounds.admits(tenant.id, is_platform=tenant.name == PLATFORM_TENANT):
            raise refused
        return tenant


def credential_headers(scope: Scope) -> tuple[str | None, str | None]:
    """``authorization`` and ``x-api-key``; AuthenticationError when either is sent twice with different values
    (which copy a proxy or a rule would read is anyone's guess)."""
    found: dict[bytes, bytes] = {}
    for key, value in scope.get("headers", ()):
        if key in (b"authorization", b"x-api-key"):
            if found.setdefault(key, value) != value:
                raise AuthenticationError(f"The '{key.decode()}' header is sent twice with different values",
                                          code="conflicting_credentials")  # fmt: skip
    authorization, api_key = found.get(b"authorization"), found.get(b"x-api-key")
    return (None if authorization is None else authorization.decode("latin-1"),
            None if api_key is None else api_key.decode("latin-1"))  # fmt: skip


class AuthMiddleware:
    """Authenticates every request outside ``public_paths``; 401 before the route runs."""

    def __init__(
        self,
        app: ASGIApp,
        authenticator: Authenticator,
        public_paths: Iterable[str] = PUBLIC_PATHS,
        console: bool = False,
    ) -> None:
        self.app = app
        self.authenticator = authenticator
        self.public_paths = frozenset(public_paths)
        self.console = console  # the console is served: /console signs its callers in itself

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        console = self.console and (path == CONSOLE_PREFIX or path.startswith(CONSOLE_PREFIX + "/"))
        if scope["type"] != "http" or path in self.public_paths or console:
            await self.app(scope, receive, send)
            return
        ctx = get_context(scope)
        try:
            with stage(ctx, "authentication"):
                ctx.principal = await self.authenticator.authenticate(*credential_headers(scope))
        except PolicyError as exc:
            await render_error(exc, ctx.request_id)(scope, receive, send)
            return
        await self.app(scope, receive, send)
