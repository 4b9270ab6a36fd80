"""One audit event per tenant API call, in the spool before the call is answered.

``AuditMiddleware`` sits inside ``RequestContextMiddleware`` (it reads the
context that authentication, the routes and the traffic policy fill in) and
outside everything else, so refused calls (401, 403, 429) are recorded too.

A response that is one body (every JSON answer) is held until its event is
written to the spool (and fsynced, with ``audit.wait_durable``); if the spool refuses the event, the client gets 503
instead of an answer with no record. A stream is recorded when it ends, just
before its last body message (which carries its ``[DONE]``): its status went
out with the first byte, so a spool failure then ends the stream with an error
event instead (and ``gateway.gate`` refuses new streams while the spool fails). A client that leaves first
gets its event recorded without waiting.

Refusals (every 4xx answer) are recorded on every route but the probes, the
admin API's included, through ``AuditTrail.record_refusal``: the first of a
(caller, route, status, reason) is written before the answer like any event,
repeats within ``audit.refusal_aggregation_seconds`` are counted into one
event at the window's end, so a flood of forged tokens cannot fill the disk.
The caller is the principal, else a non-secret name for the credential that
failed (an API key's prefix, a token's claimed issuer and subject), else the
client's address; the route is its template, never the raw path (which may
hold anything a client pasted into it). Successful admin changes are recorded
by the admin routes themselves.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from typing import Any

from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferflux.gateway.auth import PUBLIC_PATHS
from inferflux.gateway.context import TRANSPORT_KEY, get_context, header, route_template
from inferflux.gateway.errors import render_error
from inferflux.gateway.logs.redaction import redact
from inferflux.gateway.metrics import CLIENT_CLOSED_STATUS, KNOWN_METHODS
from inferflux.gateway.pipeline.sse import sse_error_end
from inferflux.gateway.tracing import stage
from inferflux.policy.audit import AuditEvent, AuditUnavailable, Finding, admin_event, api_event
from inferflux.policy.authn.apikeys import parse_key

log = logging.getLogger(__name__)

AUDITED_PREFIXES = ("/v1/",)  # every call is an event; elsewhere only refusals are (admin changes: the routes)
_DENIED = {401, 403, 404, 429}
_UNAUTHENTICATED = ("unverified:", "addr:")  # caller_without_principal's names; principals are key:, oidc:
_MAX_ERROR_BODY = 64 * 1024  # an error answer larger than this is not parsed for its code


class AuditMiddleware:
    def __init__(
        self, app: ASGIApp, *, prefixes: tuple[str, ...] = AUDITED_PREFIXES, public: frozenset[str] = PUBLIC_PATHS
    ) -> None:
        self.app = app
        self.prefixes = prefixes
        self.public = public  # probes and the scrape endpoint refuse nobody: nothing to audit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = {"start": None, "recorded": False}

        async def send_audited(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["start"] = message
                return  # held until we know whether the body is one message
            if message["type"] == "http.response.body" and not state["recorded"]:
                start = state["start"]
                if message.get("more_body", False):
                    if start is not None:  # a stream: its head goes out now, its event at the end
                        state["start"] = None
                        await send(start)
                    await send(message)
                    return
                state["recorded"] = True
                status = start["status"] if start is not None else 200
                refused = await self._record(scope, status, wait=True, body=message.get("body", b""))
                if start is not None:
                    if refused is not None:  # answer 503 rather than answer with no record
                        error = render_error(refused, get_context(scope).request_id)
                        error.headers["retry-after"] = "1"
                        await error(scope, receive, send)
                        return
                    await send(start)
                elif refused is not None:  # a stream: it ends in error, not with a bare [DONE], when not on record
                    error_end = get_context(scope).stream_error_end or sse_error_end
                    message = {**message, "body": error_end(refused)}
            await send(message)

        try:
            await self.app(scope, receive, send_audited)
        except BaseException:
            if not state["recorded"]:  # the app failed: the outer layer answers 500
                state["recorded"] = True
                await self._record(scope, 500, wait=False)
            raise
        if not state["recorded"]:  # the client left before the answer was complete
            start = state["start"]
            await self._record(scope, start["status"] if start is not None else CLIENT_CLOSED_STATUS, wait=False)

    async def _record(self, scope: Scope, status: int, *, wait: bool, body: bytes = b"") -> AuditUnavailable | None:
        """Record the call's event (a refusal's through the trail's aggregation); the error if the trail refused it."""
        app = scope["app"]
        trail = app.state.audit_trail
        if trail is None:  # the app is not started (a test calling the ASGI app bare)
            return None
        refusal = 400 <= status < 500 and status != CLIENT_CLOSED_STATUS
        if not refusal and not scope["path"].startswith(self.prefixes):
            return None
        try:
            if refusal:
                event = build_event(scope, status, app.state.traffic.digester, code=error_code(body))
                if wait:
                    with stage(get_context(scope), "audit"):
                        await trail.record_refusal(refusal_key(event), event)
                elif trail.refusals.admit(refusal_key(event), event):
                    trail.record_nowait(event)
                return None
            event = build_event(scope, status, app.state.traffic.digester)
            if wait:
                with stage(get_context(scope), "audit"):  # on disk before the answer: part of its latency
                    await trail.record(event)
            else:
                trail.record_nowait(event)
            return None
        except AuditUnavailable as exc:
            log.error("audit event for %s not recorded: %s", scope["path"], exc)
            return exc

def build_event(scope: Scope, status: int, digester: Any, *, code: str | None = None) -> AuditEvent:
    """The audit event of the call ``scope`` answered with ``status``, from its request context.

    ``code`` is a refusal's error code (its reason when no policy gave one).
    Who made the call is the principal when authentication found one, else a
    non-secret name for the credential presented, else the client's address.
    """
    ctx = get_context(scope)
    principal = ctx.principal
    reasons = tuple(ctx.reasons) or ((code,) if code else ())
    if status < 400:
        decision = "allow"
    elif status in _DENIED or ctx.reasons:
        decision = "deny"
    else:
        decision = "error"
    prompt_tokens, completion_tokens = ctx.usage if ctx.usage is not None else (None, None)
    findings = tuple(
        Finding(type=f.type, rule_id=f.rule, stage=stage, action=f.action) for stage, f in ctx.findings
    )
    return api_event(
        decision=decision,
        digester=digester,
        prompt="\n".join(ctx.prompt_texts) if ctx.prompt_texts is not None else None,
        completion="\n".join(ctx.completion_texts) if ctx.completion_texts is not None else None,
        findings=findings,
        reasons=reasons,
        request_id=ctx.request_id,
        tenant_id=principal.tenant_id if principal is not None else None,
        principal=principal.subject if principal is not None else caller_without_principal(scope),
        key_id=principal.key_id if principal is not None else None,
        route=route_of(scope),
        model=ctx.model,
        user=ctx.user,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        status=status,
        latency_ms=round((time.perf_counter() - ctx.started) * 1000, 3),
        kind="admin" if scope["path"].startswith("/admin/") else "api",
        detail=_detail(scope, status, ctx.tool_calls),
    )


def _detail(scope: Scope, status: int, tool_calls: list[str]) -> dict[str, Any] | None:
    """A refusal's client address; the names of the functions an answer called (their arguments are
    content: only digested, and kept redacted with ``debug_content``)."""
    detail: dict[str, Any] = {"client": _client(scope)} if status >= 400 else {}
    if tool_calls:
        detail["tool_calls"] = tool_calls[:64]
    return detail or None


def refusal_key(event: AuditEvent) -> tuple[str, str, int, str]:
    """What refusals are aggregated by: the caller, the route, the status and the reason.

    The caller is the principal; without one, the client's address, not the
    credential it presented: forged credentials are free to vary, so keyed by
    them a flood would get one window each.
    """
    caller = event.principal or ""
    if not caller or caller.startswith(_UNAUTHENTICATED):
        caller = f"addr:{(event.detail or {}).get('client', 'unknown')}"
    return (caller, event.route or "", event.status or 0, event.reasons[0] if event.reasons else "")


def route_of(scope: Scope) -> str:
    """``METHOD /path/{template}``: the route's template, never the raw path; ``WEBSOCKET`` in the method's
    place for a request sent on ``/v1/websocket`` (``gateway.websocket``).

    A raw path can hold anything a client typed, a key pasted in the wrong
    place included, and is unbounded; a refusal answered before routing (a
    401) is matched against the app's routes here.
    """
    method = scope.get("method", "")
    method = method if method in KNOWN_METHODS else "OTHER"
    if scope.get(TRANSPORT_KEY) == "websocket":  # sent on /v1/websocket, as the route's POST
        method = "WEBSOCKET"
    template = route_template(scope)
    if template == "unmatched":
        app = scope.get("app")
        for route in getattr(getattr(app, "router", None), "routes", ()):
            if isinstance(route, Route) and route.matches(scope)[0] is not Match.NONE:
                template = route.path
                break
    return f"{method} {template}"


def caller_without_principal(scope: Scope) -> str:
    """``unverified:key:<prefix>`` or ``unverified:jwt:<iss>#<sub>`` for a presented credential, else ``addr:<ip>``.

    Only what is not secret: an API key's public prefix, a token's issuer and
    subject (as claimed: the token did not verify), and nothing that looks
    like a credential itself.
    """
    token = _presented_token(scope)
    if token:
        parsed = parse_key(token)
        if parsed is not None:
            return f"unverified:key:{parsed.prefix}"
        claims = _unverified_claims(token)
        if claims is not None:
            iss, sub = _claim(claims, "iss"), _claim(claims, "sub")
            return f"unverified:jwt:{iss}#{sub}"
    return f"addr:{_client(scope)}"


def error_code(body: bytes) -> str | None:
    """The ``error.code`` (or ``error.type``) of an OpenAI-shaped error answer, if it is one."""
    if not body or len(body) > _MAX_ERROR_BODY:
        return None
    try:
        error = json.loads(body).get("error")
        code = error.get("code") or error.get("type")
    except (ValueError, AttributeError):
        return None
    return code[:64] if isinstance(code, str) and code.isprintable() and code else None


def _presented_token(scope: Scope) -> str | None:
    authorization = header(scope, b"authorization")
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        return value.strip() if scheme.lower() == "bearer" else None
    return (header(scope, b"x-api-key") or "").strip() or None


def _unverified_claims(token: str) -> dict[str, Any] | None:
    parts = token.split(".")
    if len(parts) != 3 or len(parts[1]) > 8192:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
        return None
    return claims if isinstance(claims, dict) else None


def _claim(claims: dict[str, Any], name: str) -> str:
    value = claims.get(name)
    if not isinstance(value, str) or not value.isprintable() or redact(value) != value:
        return "?"  # absent, or not something to write down (it looks like a credential)
    return value[:100]


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0])[:64] if client else "unknown"


# -- admin changes: the attempt before the change -------------------------------------------

CHANGE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def changes_admin_state(request: Any) -> bool:
    return request.method in CHANGE_METHODS and request.url.path.startswith("/admin/")


def _attempted_tenant(request: Any, principal: Any) -> str:
    """The tenant whose state the change would touch, as its outcome's event names it; else the caller's.

    Only a path value that can be a tenant id: a platform admin may send any text there (the
    route answers 404 for it), and the attempt must be recordable whatever was sent."""
    named = request.path_params.get("tenant_id")
    if isinstance(named, str) and 1 <= len(named) <= 64 and named.isascii() and named.isprintable():
        return named
    return str(principal.tenant_id)


async def record_attempt(request: Any, principal: Any) -> None:
    """Put an authorised admin change's attempt on the trail before the change is made.

    The change's own event (``gateway.routes.admin.common.record_change``) can only be written after
    the change, so a spool that fails in between would leave a change nobody audited.
    With its attempt written first, a change and a record of it go together or neither
    happens: a spool that cannot take the attempt refuses the change (503, nothing
    changed), and one that fails afterwards still holds the attempt, which names the
    caller, the route and the request id of the change it could not record.
    """
    ctx = get_context(request)
    event = admin_event(
        principal=principal.subject,
        action="attempt",
        target_kind="route",
        tenant_id=_attempted_tenant(request, principal),
        key_id=principal.key_id,
        request_id=ctx.request_id,
        route=f"{request.method} {route_template(request.scope)}",
    )
    try:
        await request.app.state.audit_trail.record(event)
    except AuditUnavailable as exc:
        raise AuditUnavailable(
            f"Nothing was changed: the audit trail cannot record the change ({exc.message}); retry shortly",
            headers={"retry-after": "1"},
        ) from None
