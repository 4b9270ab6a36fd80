"""Deadlines for slow clients: headers, body, idle keep-alive connections and responses nobody reads.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but
only once a response has been sent, and only while nothing arrives: a socket
that connects and sends nothing, or a byte of a request line every few seconds,
holds a connection (and its memory) for ever. Three deadlines close that:

* **Headers** (``SlowClientDeadlines``, the HTTP protocol uvicorn runs): a request's
  headers must be complete ``header_timeout_seconds`` after the connection opens,
  or after the previous answer on a kept-alive connection; otherwise the
  connection is closed. Nothing of the app runs for such a request.
* **Body** (``BodyDeadlineMiddleware``, ASGI): once the headers are in, the body
  must be complete within ``body_timeout_seconds``; otherwise reading it raises
  ``RequestTimeout`` (408, ``connection: close``), answered and audited like
  any other error, and the connection is closed. A client that stalls after its
  body (a stream it reads slowly) is not affected: only reading the body is timed.
* **Writes** (the same protocol, ``server.stream_write_timeout_seconds``): the
  transport tells the protocol when its buffer passes the high-water mark (the
  kernel's socket buffer is full: the client is not taking what was sent) and
  when it drains again; while paused, uvicorn's ``send`` waits. A connection
  paused that long is reset (its unsent bytes dropped, not kept for a client
  that may never read them). A response still running gets ``client_timeout`` among its audit
  reasons, and the abort reaches the app as a disconnect, so a stream's
  sequence is aborted and its KV freed at once (``gateway.pipeline.sse``). Without
  it a client that reads nothing would hold its stream, its queued output and
  its concurrency slot as long as the connection lasts.

``server_options`` gives uvicorn all three, with the keep-alive timeout; ``inferctl
serve`` and the tests' live servers use it, so they run what production runs.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferflux.gateway.context import SCOPE_KEY
from inferflux.gateway.errors import GatewayError

log = logging.getLogger("inferflux.gateway.slowclients")

# The audit reason of a call whose client stopped reading its answer (server.stream_write_timeout_seconds).
CLIENT_TIMEOUT_REASON = "client_timeout"

if TYPE_CHECKING:
    from inferflux.gateway.settings import InputLimitSettings, WebSocketSettings


class RequestTimeout(GatewayError):
    """408: the request's body did not arrive in time; the connection is closed."""

    status_code = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


def _protocol_base() -> type:
    """The protocol uvicorn's ``http="auto"`` picks: httptools where installed, else h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:  # uvicorn without its [standard] extra
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def deadline_protocol(header_timeout: float, write_timeout: float | None = None) -> type:
    """uvicorn's HTTP protocol, closing a connection whose request headers take longer than
    ``header_timeout``, or whose client takes nothing of a response for ``write_timeout``."""
    base: Any = _protocol_base()

    class SlowClientDeadlines(base):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_deadline()  # the next request's headers have as long

        def connection_lost(self, exc: Exception | None) -> None:
            for timer in (self._header_timer, self._write_timer):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout, self._header_deadline_passed)

        def _header_deadline_passed(self) -> None:
            self._header_timer = None
            if self.transport.get_protocol() is not self:  # upgraded to a WebSocket: no longer an HTTP connection
                return
            # A cycle that has not answered yet means its headers arrived: the body has its own deadline.
            if self.cycle is not None and not self.cycle.response_complete:
                return
            if not self.transport.is_closing():
                self.transport.close()

        def pause_writing(self) -> None:
            super().pause_writing()
            if write_timeout is not None and self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._write_deadline_passed)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_deadline_passed(self) -> None:
            self._write_timer = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                _client_timed_out(cycle.scope, write_timeout)
            _drop(self.transport)

    return SlowClientDeadlines


def _client_timed_out(scope: Scope, write_timeout: float | None) -> None:
    """A response still running when its client stopped taking it: its audit event says why it ended."""
    ctx = scope.get(SCOPE_KEY)
    if ctx is not None:
        ctx.reasons.append(CLIENT_TIMEOUT_REASON)
    log.info("request %s: its client took nothing for %g s; connection closed "
             "(server.stream_write_timeout_seconds)", getattr(ctx, "request_id", "-"), write_timeout)  # fmt: skip


def _drop(transport: Any) -> None:
    """Close with a reset: the unsent bytes are discarded at once. A plain close would wait
    for the client to read them (the transport's buffer, then the kernel's orphaned socket)."""
    sock = transport.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except (OSError, AttributeError):  # not a TCP socket, or already gone: the abort still closes it
        pass
    transport.abort()


def server_options(limits: InputLimitSettings, stream_write_timeout: float | None = None,
                   websocket: WebSocketSettings | None = None) -> dict[str, Any]:  # fmt: skip
    """Keyword arguments for ``uvicorn.Config``: the header and write deadlines and the keep-alive timeout;
    with ``websocket``, the WebSocket pings and the largest frame read (``gateway.websocket``)."""
    options: dict[str, Any] = {
        "http": deadline_protocol(limits.header_timeout_seconds, stream_write_timeout),
        "timeout_keep_alive": limits.keep_alive_timeout_seconds,
    }
    if websocket is not None:
        options.update(ws_ping_interval=websocket.ping_interval_seconds, ws_ping_timeout=websocket.ping_interval_seconds,
                       # Up to twice the limit is read, so that an oversize message gets its 413 event, not a close.
                       ws_max_size=2 * websocket.max_message_bytes)  # fmt: skip
    return options


class BodyDeadlineMiddleware:
    """Raises ``RequestTimeout`` from ``receive`` when the body is not complete ``seconds`` after the request began."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        body_done = False

        async def receive_in_time() -> Message:
            nonlocal body_done
            if body_done:  # after the body: waiting for a disconnect, untimed
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeout(
                    f"The request body did not arrive within {self.seconds:g} seconds",
                    headers={"connection": "close"},
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, receive_in_time, send)
