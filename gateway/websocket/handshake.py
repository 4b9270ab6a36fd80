"""A WebSocket connection's handshake, and the audit events of what is refused on the connection itself.

The handshake is authenticated as an HTTP request is (the ``Authorization`` or
``x-api-key`` header; never a query string, which access logs would keep) and
refused with the HTTP answer before the upgrade: 401 without valid credentials,
403 without the generate scope, 503 while the server drains or while the audit
spool cannot take events. Its refusal is on the trail as a refused HTTP request's
is (route ``GET /v1/websocket``); so is each message the connection refuses
before it runs (413, 400, 429: route ``WEBSOCKET /v1/websocket``), through the
trail's aggregation of repeated refusals.
"""

from __future__ import annotations

import contextlib

from starlette.types import Scope
from starlette.websockets import WebSocket

from inferflux.gateway.audit import build_event, refusal_key
from inferflux.gateway.auth import credential_headers
from inferflux.gateway.context import SCOPE_KEY, TRANSPORT_KEY, RequestContext, get_context, new_request_id
from inferflux.gateway.drain import ShuttingDown
from inferflux.gateway.errors import render_error
from inferflux.gateway.state import GatewayState
from inferflux.policy.errors import ApiError
from inferflux.policy.rbac import Principal, Scope as Permission

REQUIRED = Permission.GENERATE  # the handshake's scope: every request on the connection generates


async def admit(ws: WebSocket, state: GatewayState) -> Principal | None:
    """The connection's principal; None if the handshake was refused (its HTTP answer sent)."""
    ctx = get_context(ws.scope)
    try:
        refusal = ShuttingDown() if state.drain.draining else state.audit_health.refusal()
        if refusal is not None:
            raise refusal
        ctx.principal = principal = await state.authenticator.authenticate(*credential_headers(ws.scope))
        principal.require(REQUIRED)
    except ApiError as exc:
        await record_refusal({**ws.scope, "method": "GET"}, state, exc)
        answer = render_error(exc, ctx.request_id)
        if "websocket.http.response" in ws.scope.get("extensions", {}):
            await ws.send_denial_response(answer)
        else:  # a server without denial responses: the close before accept is its 403
            await ws.close(code=1008)
        return None
    return principal


def message_scope(ws_scope: Scope, principal: Principal) -> Scope:
    """The scope a message refused on the connection is audited under: its own request id, the connection's caller."""
    return {**ws_scope, SCOPE_KEY: RequestContext(request_id=new_request_id(), principal=principal),
            TRANSPORT_KEY: "websocket"}  # fmt: skip


async def record_refusal(scope: Scope, state: GatewayState, exc: ApiError) -> None:
    """``exc``'s event, as ``AuditMiddleware`` records an HTTP answer of its status (a 4xx aggregated)."""
    trail = state.audit_trail
    if trail is None:  # the app is not started
        return
    event = build_event(scope, exc.status_code, state.traffic.digester, code=exc.code)
    with contextlib.suppress(ApiError):  # the trail cannot take it: the refusal stands all the same
        if 400 <= exc.status_code < 500:
            await trail.record_refusal(refusal_key(event), event)
        else:
            await trail.record(event)
