"""One audit event per tenant API call, in the spool before the call is answered.

``AuditMiddleware`` sits inside ``RequestContextMiddleware`` (it reads the
context that authentication, the routes and the traffic policy fill in) and
outside everything else, so refused calls (401, 403, 429) are recorded too.

A response that is one body (every JSON answer) is held until its event is
written to the spool (and fsynced, with ``audit.wait_durable``); if the spool refuses the event, the client gets 503
instead of an answer with no record. A stream is recorded when it ends, just
before its last (empty) body message: its status went out with the first
byte, so a spool failure then can only be logged. A client that leaves first
gets its event recorded without waiting.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.context import get_context
from gateway.errors import render_error
from gateway.metrics import CLIENT_CLOSED_STATUS
from policy.audit import AuditEvent, AuditUnavailable, Finding, api_event

log = logging.getLogger(__name__)

AUDITED_PREFIXES = ("/v1/",)
_DENIED = {401, 403, 429}


class AuditMiddleware:
    def __init__(self, app: ASGIApp, *, prefixes: tuple[str, ...] = AUDITED_PREFIXES) -> None:
        self.app = app
        self.prefixes = prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefixes):
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
                refused = await self._record(scope, start["status"] if start is not None else 200, wait=True)
                if start is not None:
                    if refused is not None:  # answer 503 rather than answer with no record
                        error = render_error(refused, get_context(scope).request_id)
                        error.headers["retry-after"] = "1"
                        await error(scope, receive, send)
                        return
                    await send(start)
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

    async def _record(self, scope: Scope, status: int, *, wait: bool) -> AuditUnavailable | None:
        """Record the call's event; the error if the trail refused it."""
        app = scope["app"]
        trail = app.state.audit_trail
        if trail is None:  # the app is not started (a test calling the ASGI app bare)
            return None
        try:
            event = build_event(scope, status, app.state.traffic.digester)
            if wait:
                await trail.record(event)
            else:
                trail.record_nowait(event)
            return None
        except AuditUnavailable as exc:
            log.error("audit event for %s not recorded: %s", scope["path"], exc)
            return exc

def build_event(scope: Scope, status: int, digester: Any) -> AuditEvent:
    """The audit event of the call ``scope`` answered with ``status``, from its request context."""
    ctx = get_context(scope)
    principal = ctx.principal
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
        reasons=tuple(ctx.reasons),
        request_id=ctx.request_id,
        tenant_id=principal.tenant_id if principal is not None else None,
        principal=principal.subject if principal is not None else None,
        key_id=principal.key_id if principal is not None else None,
        route=f"{scope['method']} {scope['path']}",
        model=ctx.model,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        status=status,
        latency_ms=round((time.perf_counter() - ctx.started) * 1000, 3),
    )
