"""One WebSocket connection: its handshake, its messages, its requests in flight, its close.

The handshake is authenticated as an HTTP request is (the ``Authorization`` or
``x-api-key`` header; never a query string, which logs would keep) and refused
with the HTTP answer before the upgrade: 401 without valid credentials, 403
without the generate scope, 503 while the server drains. Each request is then
run through the whole app (``gateway.websocket.dispatch``), so its credentials
are checked again there.

The connection counts as in flight for the drain (``gateway.drain``): once a
drain begins it reads no more messages, lets its requests finish (or end at the
drain's deadline, in error), and closes with 1001. A client gone cancels its
requests; a connection with nothing in flight that sends nothing for
``idle_timeout_seconds`` is closed (1000).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from inferflux.gateway.audit import build_event, refusal_key
from inferflux.gateway.auth import credential_headers
from inferflux.gateway.authz import SCOPE_ATTR
from inferflux.gateway.context import get_context
from inferflux.gateway.drain import ShuttingDown
from inferflux.gateway.errors import InvalidRequest, RateLimited, render_error
from inferflux.gateway.settings import WebSocketSettings
from inferflux.gateway.state import GatewayState
from inferflux.gateway.websocket.dispatch import request_scope, run_request
from inferflux.gateway.websocket.protocol import BadMessage, error_event, parse_message
from inferflux.policy.errors import ApiError
from inferflux.policy.rbac import Scope

log = logging.getLogger("inferflux.gateway.websocket")

REQUIRED = Scope.GENERATE  # the handshake's scope: every request on the connection generates
GOING_AWAY = 1001  # the server drains
NORMAL = 1000  # idle


async def admit(ws: WebSocket, state: GatewayState) -> bool:
    """Whether the handshake may be accepted; if not, the HTTP refusal has been sent."""
    try:
        if state.drain.draining:
            raise ShuttingDown()
        principal = await state.authenticator.authenticate(*credential_headers(ws.scope))
        principal.require(REQUIRED)
    except ApiError as exc:
        await _audit_refusal(ws, state, exc)
        refusal = render_error(exc, get_context(ws.scope).request_id)
        if "websocket.http.response" in ws.scope.get("extensions", {}):
            await ws.send_denial_response(refusal)
        else:  # a server without denial responses: the close before accept is its 403
            await ws.close(code=1008)
        return False
    return True


async def _audit_refusal(ws: WebSocket, state: GatewayState, exc: ApiError) -> None:
    """A refused handshake is on the trail as a refused HTTP request is (route ``GET /v1/websocket``)."""
    trail = state.audit_trail
    if trail is None:  # the app is not started
        return
    event = build_event({**ws.scope, "method": "GET"}, exc.status_code, state.traffic.digester, code=exc.code)
    with contextlib.suppress(ApiError):  # the trail cannot take it: the handshake is refused all the same
        await trail.record_refusal(refusal_key(event), event)


class Session:
    """A connection's requests: each a task, by the id its client gave it."""

    def __init__(self, ws: WebSocket, state: GatewayState, settings: WebSocketSettings) -> None:
        self.ws = ws
        self.state = state
        self.settings = settings
        self.tasks: dict[str, tuple[asyncio.Task[None], asyncio.Event]] = {}
        self.send_lock = asyncio.Lock()
        self.open = True
        self.loop = asyncio.get_running_loop()
        self.quiet_since = self.loop.time()  # when the connection last received a message or ended a request

    async def emit(self, event: dict[str, Any]) -> None:
        """Send ``event``; once the client is gone, nothing (its requests are being cancelled)."""
        if not self.open:
            return
        try:
            async with self.send_lock:
                await self.ws.send_text(json.dumps(event, ensure_ascii=False, separators=(",", ":")))
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.gone()

    def gone(self) -> None:
        self.open = False
        for _, cancelled in self.tasks.values():
            cancelled.set()

    async def run(self) -> None:
        drain = self.state.drain
        drain.inflight += 1  # the drain waits for this connection to close
        try:
            await self._read(drain.begun)
            await asyncio.gather(*(task for task, _ in self.tasks.values()), return_exceptions=True)
            if self.open and drain.draining:
                await self._close(GOING_AWAY, "server shutting down")
        finally:
            self.gone()  # what still runs (the client left, or the server cancelled us) is cancelled
            await asyncio.gather(*(task for task, _ in self.tasks.values()), return_exceptions=True)
            drain.inflight -= 1

    async def _read(self, draining: asyncio.Event) -> None:
        """Messages until the client leaves, a drain begins, or the connection idles out."""
        stop = asyncio.ensure_future(draining.wait())
        receive: asyncio.Future[Any] | None = None
        try:
            while self.open and not draining.is_set():
                receive = receive or asyncio.ensure_future(self.ws.receive())
                idle = self.settings.idle_timeout_seconds
                # Idle: nothing in flight, and nothing received since the last request ended.
                quiet = None if self.tasks else self.quiet_since + idle - self.loop.time()
                done, _ = await asyncio.wait({receive, stop}, timeout=idle if quiet is None else max(quiet, 0),
                                             return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                if receive in done:
                    message, receive = receive.result(), None
                    self.quiet_since = self.loop.time()
                    await self._received(message)
                elif not done and not self.tasks and self.loop.time() - self.quiet_since >= idle:
                    await self._close(NORMAL, "idle timeout")
        finally:
            stop.cancel()
            if receive is not None:
                receive.cancel()
                with contextlib.suppress(BaseException):
                    await receive

    async def _received(self, message: dict[str, Any]) -> None:
        if message["type"] == "websocket.disconnect":
            self.gone()
            return
        text = message.get("text")
        if text is None:
            text = message.get("bytes") or b""
        try:
            parsed = parse_message(text, self.settings.max_message_bytes)
        except BadMessage as exc:
            await self.emit(error_event(exc.id, exc.error))
            return
        if parsed.path is None:
            await self._cancel(parsed.id)
        else:
            await self._start(parsed.id, parsed.path, parsed.body)

    async def _cancel(self, id: str) -> None:
        running = self.tasks.get(id)
        if running is None:
            await self.emit(error_event(id, InvalidRequest(f"No request {id!r} is in flight", param="id",
                                                           code="unknown_id")))  # fmt: skip
            return
        running[1].set()

    async def _start(self, id: str, path: str, body: bytes) -> None:
        if id in self.tasks:
            await self.emit(error_event(id, InvalidRequest(f"A request {id!r} is in flight already",
                                                                   param="id", code="duplicate_id")))  # fmt: skip
            return
        if len(self.tasks) >= self.settings.max_in_flight:
            limit = self.settings.max_in_flight
            refusal = RateLimited(f"This connection has {limit} requests in flight, its limit (websocket.max_in_flight)",
                                  code="too_many_in_flight")  # fmt: skip
            await self.emit(error_event(id, refusal))
            return
        cancelled = asyncio.Event()
        scope = request_scope(self.ws.scope, path, body)
        task = asyncio.create_task(run_request(self.ws.scope["app"], scope, body, id, self.emit,
                                               cancelled))  # fmt: skip
        self.tasks[id] = (task, cancelled)
        task.add_done_callback(lambda _: self._ended(id))

    def _ended(self, id: str) -> None:
        self.tasks.pop(id, None)
        self.quiet_since = self.loop.time()

    async def _close(self, code: int, reason: str) -> None:
        self.open = False
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
            await self.ws.close(code=code, reason=reason)


async def serve(ws: WebSocket) -> None:
    """``/v1/websocket``: the handshake, then the session."""
    state: GatewayState = ws.app.state
    if not await admit(ws, state):
        return
    await ws.accept()
    await Session(ws, state, state.settings.websocket).run()


setattr(serve, SCOPE_ATTR, REQUIRED)  # declared as ``@requires`` declares an HTTP route's (tests and docs list it)
