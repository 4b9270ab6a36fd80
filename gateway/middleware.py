"""Pure-ASGI middleware that guards the request body."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferflux.gateway.context import get_context
from inferflux.gateway.errors import GatewayError, InvalidRequest, RequestTooLarge


class BodyLimitMiddleware:
    """Rejects request bodies larger than ``max_bytes`` with 413.

    A declared Content-Length over the limit is refused before any of the body
    is read; a chunked body is counted as it arrives, and the error raised
    from ``receive`` reaches the route's caller like any other GatewayError.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> RequestTooLarge:
        return RequestTooLarge(f"The request body exceeds the limit of {self.max_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared: str | None = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                declared = value.decode("latin-1")
                break
        error: GatewayError | None = None
        if declared is not None:
            if not declared.strip().isdigit():
                error = InvalidRequest("The Content-Length header is not a number")
            elif int(declared) > self.max_bytes:
                error = self._too_large()
        if error is not None:
            response = error.to_response(get_context(scope).request_id)
            # The unread body would otherwise be parsed as the next request.
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return

        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, receive_limited, send)
