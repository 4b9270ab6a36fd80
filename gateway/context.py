"""Per-request context carried in the ASGI scope.

The context is created by the outermost middleware so every later layer
(authentication fills ``principal``, rate limiting and audit read it, the
routes fill ``model``) shares one object instead of re-deriving things from
headers.
"""

from __future__ import annotations

import re
import secrets
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.datastructures import MutableHeaders
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from inferflux.gateway.tracing import RequestTrace, Tracing
    from inferflux.policy.errors import ApiError

SCOPE_KEY = "inferflux.context"
# "websocket" on a request sent over a WebSocket connection (gateway.websocket): its audit route says so.
TRANSPORT_KEY = "inferflux.transport"
REQUEST_ID_HEADER = "x-request-id"

# A caller-supplied id ends up in logs and (later) audit records; accept only a
# conservative shape so it cannot inject separators or grow unbounded.
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def new_request_id() -> str:
    return secrets.token_hex(12)


@dataclass
class RequestContext:
    request_id: str
    started: float = field(default_factory=time.perf_counter)
    # Set by the authentication layer; None means anonymous.
    principal: Any | None = None
    # The served model's canonical name once a route has resolved it.
    model: str | None = None
    # The end user the caller named (OpenAI's ``user``), for the audit event and OPA: cut, credentials redacted.
    user: str | None = None
    # Filled by the traffic policy on generation routes, read by the audit event.
    prompt_texts: list[str] | None = None
    completion_texts: list[str] | None = None
    findings: list[tuple[str, Any]] = field(default_factory=list)  # ("input" | "output", guardrail finding)
    reasons: list[str] = field(default_factory=list)  # why a policy refused, if one did
    usage: tuple[int, int] | None = None  # prompt and completion tokens
    tool_calls: list[str] = field(default_factory=list)  # the functions the answer called (names only)
    # How this call's SSE stream ends in error, once its headers are gone: each API frames it its own
    # way (OpenAI's [DONE], the Responses and Messages APIs' events). Set by the streaming response.
    stream_error_end: Callable[[ApiError], bytes] | None = None
    # The request's OpenTelemetry span and its stages (gateway.tracing); None while tracing is off.
    trace: RequestTrace | None = None


# The context of the request this task serves, for what has no scope at hand (the JSON log lines).
CURRENT: ContextVar[RequestContext | None] = ContextVar("inferflux_request", default=None)


def header(scope: Scope, name: bytes) -> str | None:
    """The request's first header ``name`` (lower case, as ASGI gives it); None if it sent none."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def route_template(scope: Scope) -> str:
    """The matched route's path template; a fixed label for unmatched paths.

    Raw paths would give every probed URL (and every model id in
    ``/v1/models/{id}``) its own metric series, trace name or audit route.
    """
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


def get_context(conn: HTTPConnection | Scope) -> RequestContext:
    """The request's context; one is created if no middleware did (e.g. unit tests)."""
    scope = conn.scope if isinstance(conn, HTTPConnection) else conn
    ctx = scope.get(SCOPE_KEY)
    if ctx is None:
        ctx = RequestContext(request_id=new_request_id())
        scope[SCOPE_KEY] = ctx
    return ctx


class RequestContextMiddleware:
    """Creates the RequestContext and echoes the request id in the response; with ``tracing``, the
    request's span runs from here to its last byte (the audit event's write included)."""

    def __init__(self, app: ASGIApp, tracing: Tracing | None = None) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = header(scope, b"x-request-id") or ""
        request_id = incoming if _REQUEST_ID_RE.match(incoming) else new_request_id()
        scope[SCOPE_KEY] = ctx = RequestContext(request_id=request_id)
        if self.tracing is not None:
            ctx.trace = self.tracing.begin(scope, ctx.started, request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if REQUEST_ID_HEADER not in headers:
                    headers.append(REQUEST_ID_HEADER, request_id)
                if ctx.trace is not None:
                    ctx.trace.status = message["status"]
            await send(message)

        token = CURRENT.set(ctx)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            CURRENT.reset(token)
            if ctx.trace is not None:
                tenant = None if ctx.principal is None else str(ctx.principal.tenant_id)
                ctx.trace.end(route_template(scope), tenant, ctx.model)
