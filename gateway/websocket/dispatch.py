"""One WebSocket request, run as the HTTP request it stands for, through the whole app.

The request is not a side path: it enters the app at its outermost layer as a
``POST`` to its HTTP route, with the handshake's headers (its credentials among
them), so every layer a client's HTTP request meets runs for it again:
authentication (a key revoked since the handshake is refused here), the gate
(a draining server's 503), the audit event (its route ``WEBSOCKET /v1/...``), the
metrics, the limits, and the pipeline with its policy steps. What the app sends
back is turned into events: the SSE stream's chunks one by one, its end as
``done``, an error answer as an ``error`` event with the status it carried.

The request's ``receive`` gives its body, then waits: a cancel (the client's
message, or the socket gone) is the ``http.disconnect`` an HTTP client's leaving
would be, and the pipeline ends the engine's work and records the call (499).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Message, Scope

from inferflux.gateway.context import TRANSPORT_KEY
from inferflux.gateway.errors import InternalError
from inferflux.gateway.metrics import CLIENT_CLOSED_STATUS
from inferflux.gateway.websocket.protocol import error_event

log = logging.getLogger("inferflux.gateway.websocket")

Emit = Callable[[dict[str, Any]], Awaitable[None]]

# The handshake's headers that describe the WebSocket, not the request (the body's are the request's own).
_NOT_CARRIED = frozenset({b"connection", b"upgrade", b"content-length", b"content-type", b"transfer-encoding",
                          b"x-request-id"})  # fmt: skip


def request_scope(ws_scope: Scope, path: str, body: bytes) -> Scope:
    """The HTTP scope of a request sent on the connection ``ws_scope`` describes."""
    headers = [(k, v) for k, v in ws_scope.get("headers", ())
               if k not in _NOT_CARRIED and not k.startswith(b"sec-websocket-")]  # fmt: skip
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "https" if ws_scope.get("scheme") == "wss" else "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": ws_scope.get("root_path", ""),
        "query_string": b"",
        "headers": headers,
        "client": ws_scope.get("client"),
        "server": ws_scope.get("server"),
        "state": dict(ws_scope.get("state", {})),  # the lifespan's, as each HTTP request gets a copy
        "extensions": {},
        TRANSPORT_KEY: "websocket",
    }


class _Events:
    """The app's answer to one request, turned into that request's events as it is sent."""

    def __init__(self, id: str, emit: Emit) -> None:
        self.id = id
        self.emit = emit
        self.status = 0
        self.request_id: str | None = None
        self.stream = False
        self.buffer = b""
        self.ended = False  # ``done`` or ``error`` went out

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            for key, value in message.get("headers", ()):
                if key == b"x-request-id":
                    self.request_id = value.decode("latin-1")
                elif key == b"content-type":
                    self.stream = value.startswith(b"text/event-stream")
            return
        if message["type"] != "http.response.body":
            return
        self.buffer += message.get("body", b"")
        if self.stream:
            *events, self.buffer = self.buffer.split(b"\n\n")
            for event in events:
                await self._sse(event)
        elif not message.get("more_body", False):
            await self._answer(self.buffer)

    async def _sse(self, event: bytes) -> None:
        data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
        if not data or self.ended:
            return
        if data == b"[DONE]":
            self.ended = True
            await self.emit({"id": self.id, "type": "done", "request_id": self.request_id})
            return
        payload = json.loads(data)
        if isinstance(payload, dict) and "error" in payload:  # a stream ended in error once its head was sent
            self.ended = True
            status = 503 if payload["error"].get("code") == "server_shutting_down" else 500
            await self.emit({"id": self.id, "type": "error", "status": status, **payload,
                             "request_id": self.request_id})  # fmt: skip
            return
        await self.emit({"id": self.id, "type": "chunk", "data": payload})

    async def _answer(self, body: bytes) -> None:
        """A whole (not streamed) answer: an error before the stream began, or a cancelled request's 499."""
        self.ended = True
        if self.status == CLIENT_CLOSED_STATUS:
            await self.emit({"id": self.id, "type": "cancelled", "request_id": self.request_id})
            return
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        error = payload.get("error") if isinstance(payload, dict) else None
        if not isinstance(error, dict):  # an answer no route of ours gives: report it, never forward it
            log.error("websocket request %s: unexpected answer with status %d", self.request_id, self.status)
            await self.emit(error_event(self.id, InternalError("The request had no answer"), self.request_id))
            return
        await self.emit({"id": self.id, "type": "error", "status": self.status, "error": error,
                         "request_id": self.request_id})  # fmt: skip


async def run_request(app: ASGIApp, scope: Scope, body: bytes, id: str, emit: Emit, cancelled: asyncio.Event) -> None:
    """The request ``scope`` describes, with ``body``, through ``app``; its answer emitted as events of ``id``.
    ``cancelled`` set is the client's disconnect."""
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await cancelled.wait()
        return {"type": "http.disconnect"}

    events = _Events(id, emit)
    try:
        await app(scope, receive, events.send)
    except Exception:  # the app's error layer has answered already (a 500 event); the socket stays up
        log.exception("websocket request %s failed", id)
    if not events.ended:  # the client left mid-stream, or the app ended with no end
        if cancelled.is_set():
            await emit({"id": id, "type": "cancelled", "request_id": events.request_id})
        else:
            await emit(error_event(id, InternalError("The answer ended early"), events.request_id))
