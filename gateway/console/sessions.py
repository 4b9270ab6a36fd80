"""Console sessions: a random cookie for a principal the API would accept, kept server-side, checked each request.

Signing in proves a credential once, through the API's own ``Authenticator``
(an API key, or an OIDC ID token from the code flow). The session keeps what
that proved, never an API key: the principal, the key's id (an API-key session)
or the ID token (an OIDC session, as short-lived as the token). Each request
checks it again as the API would: the key is looked up by id (revoked, expired,
its tenant disabled: the session ends), the token goes through the
authenticator again (its provider removed, its role binding gone: it ends).

The cookie holds 32 random bytes; the table is keyed by their SHA-256, so a
read of the table (a heap dump, a debugger) gives no usable cookie. Sessions
live in this replica's memory: behind a load balancer the console needs sticky
sessions, and a restart signs everyone out (docs/operators.md, Console).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import Response

from inferflux.gateway.auth import Authenticator, call_store
from inferflux.policy.errors import NotFound, PolicyError
from inferflux.policy.rbac import Principal
from inferflux.policy.store import PolicyStore

COOKIE = "inferflux_console"
LOGIN_COOKIE = "inferflux_console_login"  # the sign-in form's double-submit CSRF token, before any session
COOKIE_PATH = "/console"
SESSION_SECONDS = 8 * 3600  # absolute lifetime
IDLE_SECONDS = 30 * 60  # ends after this long without a request
MAX_SESSIONS = 10_000


@dataclass
class Session:
    principal: Principal
    csrf: str  # the synchronizer token every state-changing form of this session carries
    expires: float
    last_seen: float
    key_id: str | None = None
    id_token: str | None = field(default=None, repr=False)


def _digest(cookie: str) -> bytes:
    return hashlib.sha256(cookie.encode("utf-8", "surrogatepass")).digest()


class SessionStore:
    def __init__(
        self,
        store: PolicyStore,
        authenticator: Authenticator,
        *,
        lifetime: float = SESSION_SECONDS,
        idle: float = IDLE_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.authenticator = store, authenticator
        self.lifetime, self.idle, self._clock = lifetime, idle, clock
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, principal: Principal, *, id_token: str | None = None) -> tuple[str, Session]:
        """A new session for ``principal``; the cookie value (returned once, kept nowhere)."""
        now = self._clock()
        expires = now + self.lifetime
        if principal.expires_at is not None:
            expires = min(expires, principal.expires_at)
        cookie = secrets.token_urlsafe(32)
        session = Session(principal, secrets.token_urlsafe(32), expires, now, principal.key_id, id_token)
        self._sessions[_digest(cookie)] = session
        while len(self._sessions) > MAX_SESSIONS:  # the oldest sign-in goes first
            self._sessions.popitem(last=False)
        return cookie, session

    def close(self, cookie: str | None) -> None:
        if cookie:
            self._sessions.pop(_digest(cookie), None)

    async def resolve(self, cookie: str | None) -> Session | None:
        """The live session of ``cookie``, checked against the store now; None (and forgotten) otherwise."""
        if not cookie or len(cookie) > 128:
            return None
        digest = _digest(cookie)
        session = self._sessions.get(digest)
        if session is None:
            return None
        now = self._clock()
        if now >= session.expires or now - session.last_seen >= self.idle or not await self._still_valid(session):
            self._sessions.pop(digest, None)
            return None
        session.last_seen = now
        return session

    async def _still_valid(self, session: Session) -> bool:
        principal = session.principal
        try:
            if session.id_token is not None:
                session.principal = await self.authenticator.authenticate(f"Bearer {session.id_token}", None)
                return True
            if session.key_id is None:
                return False
            key = await call_store(self.store.get_api_key, principal.tenant_id, session.key_id)
            tenant = await call_store(self.store.get_tenant, principal.tenant_id)
        except NotFound:
            return False
        except PolicyError as exc:
            if exc.status_code in (401, 403):
                return False
            raise  # the store is down: 503, as the API would answer, not a silent sign-out
        now = datetime.now(UTC)
        expired = key.expires_at is not None and key.expires_at <= now
        return key.revoked_at is None and not expired and not tenant.disabled


def csrf_matches(expected: str, given: str | None) -> bool:
    return bool(given) and hmac.compare_digest(expected.encode(), (given or "").encode())


def set_cookie(response: Response, request: Request, name: str, value: str, max_age: int) -> None:
    """HttpOnly, SameSite=Strict, scoped to /console; Secure when the console is served over TLS."""
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_cookie(response: Response, request: Request, name: str) -> None:
    response.delete_cookie(name, path=COOKIE_PATH, httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")  # fmt: skip
