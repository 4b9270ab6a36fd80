"""One WebSocket connection: its messages, its requests in flight, its close.

Once the handshake is admitted (``gateway.websocket.handshake``), each request is
run through the whole app (``gateway.websocket.dispatch``), so its credentials
are checked again there; what the connection refuses itself (a message too
large or unreadable, one request too many) is an error event, audited, and the
connection stays open.

The connection counts as in flight for the drain (``gateway.drain``): once a
drain begins it reads no more messages, lets its requests finish (or end at the
drain's deadline, in error), and closes with 1001. A client gone cancels its
requests; a connection with nothing in flight that receives nothing for
``idle_timeout_seconds`` is closed (1000).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from inferflux.gateway.authz import SCOPE_ATTR
from inferflux.gateway.context import SCOPE_KEY
from inferflux.gateway.errors import InvalidRequest, RateLimited
from inferflux.gateway.settings import WebSocketSettings
from inferflux.gateway.state import GatewayState
from inferflux.gateway.websocket.dispatch import request_scope, run_request
from inferflux.gateway.websocket.handshake import REQUIRED, admit, message_scope, record_refusal
from inferflux.gateway.websocket.protocol import BadMessage, error_event, parse_message
from inferflux.policy.errors import ApiError
from inferflux.policy.rbac import Principal

log = logging.getLogger("inferflux.gateway.websocket")

GOING_AWAY = 1001  # the server drains
NORMAL = 1000  # idle


class Session:
    """A connection's requests: each a task, by the id its client gave it."""

    def __init__(self, ws: WebSocket, state: GatewayState, settings: WebSocketSettings, principal: Principal) -> None:
        self.ws = ws
        self.state = state
        self.principal = principal  # the handshake's: the caller of the refusals audited here
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
        text = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        if not text.isascii():
            try:
                text.encode()
            except UnicodeEncodeError:  # a lone surrogate, which UTF-8 cannot carry: escaped instead
                text = json.dumps(event, separators=(",", ":"))
        try:
            async with self.send_lock:
                await self.ws.send_text(text)
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.gone()

    async def refuse(self, id: str | None, error: ApiError) -> None:
        """A message the connection refuses before it runs: audited, then answered with an error event."""
        scope = message_scope(self.ws.scope, self.principal)
        await record_refusal(scope, self.state, error)
        await self.emit(error_event(id, error, scope[SCOPE_KEY].request_id))

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
            await self.refuse(exc.id, exc.error)
            return
        if parsed.path is None:
            await self._cancel(parsed.id)
        else:
            await self._start(parsed.id, parsed.path, parsed.body)

    async def _cancel(self, id: str) -> None:
        running = self.tasks.get(id)
        if running is None:
            await self.refuse(id, InvalidRequest(f"No request {id!r} is in flight", param="id", code="unknown_id"))
            return
        running[1].set()

    async def _start(self, id: str, path: str, body: bytes) -> None:
        if id in self.tasks:
            await self.refuse(id, InvalidRequest(f"A request {id!r} is in flight already", param="id",
                                                 code="duplicate_id"))  # fmt: skip
            return
        if len(self.tasks) >= self.settings.max_in_flight:
            limit = self.settings.max_in_flight
            refusal = RateLimited(f"This connection has {limit} requests in flight, its limit "
                                  "(websocket.max_in_flight)", code="too_many_in_flight")  # fmt: skip
            await self.refuse(id, refusal)
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
    principal = await admit(ws, state)
    if principal is None:
        return
    await ws.accept()
    await Session(ws, state, state.settings.websocket, principal).run()


setattr(serve, SCOPE_ATTR, REQUIRED)  # declared as ``@requires`` declares an HTTP route's (tests and docs list it)
