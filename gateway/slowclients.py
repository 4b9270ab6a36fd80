"""Deadlines for slow clients: headers, body and idle keep-alive connections.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but
only once a response has been sent, and only while nothing arrives: a socket
that connects and sends nothing, or a byte of a request line every few seconds,
holds a connection (and its memory) for ever. Two deadlines close that:

* **Headers** (``HeaderDeadline``, the HTTP protocol uvicorn runs): a request's
  headers must be complete ``header_timeout_seconds`` after the connection opens,
  or after the previous answer on a kept-alive connection; otherwise the
  connection is closed. Nothing of the app runs for such a request.
* **Body** (``BodyDeadlineMiddleware``, ASGI): once the headers are in, the body
  must be complete within ``body_timeout_seconds``; otherwise reading it raises
  ``RequestTimeout`` (408, ``connection: close``), answered and audited like
  any other error, and the connection is closed. A client that stalls after its
  body (a stream it reads slowly) is not affected: only reading the body is timed.

``server_options`` gives uvicorn both, with the keep-alive timeout; ``inferctl
serve`` and the tests' live servers use it, so they run what production runs.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferflux.gateway.errors import GatewayError

if TYPE_CHECKING:
    from inferflux.gateway.settings import InputLimitSettings


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


def header_deadline_protocol(header_timeout: float) -> type:
    """uvicorn's HTTP protocol, closing a connection whose request headers take longer than ``header_timeout``."""
    base: Any = _protocol_base()

    class HeaderDeadline(base):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_deadline()  # the next request's headers have as long

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout, self._header_deadline_passed)

        def _header_deadline_passed(self) -> None:
            self._header_timer = None
            # A cycle that has not answered yet means its headers arrived: the body has its own deadline.
            if self.cycle is not None and not self.cycle.response_complete:
                return
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def server_options(limits: InputLimitSettings) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config``: the header deadline and the keep-alive timeout."""
    return {
        "http": header_deadline_protocol(limits.header_timeout_seconds),
        "timeout_keep_alive": limits.keep_alive_timeout_seconds,
    }


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
