"""Error bodies in Anthropic's shape for ``/v1/messages``, whichever layer refused.

A refusal can come from any layer (authentication's 401, the body limit's 413,
the service gate's 503, the route's 400s and 404s, the audit layer's 503), and
each renders the OpenAI error object. ``AnthropicErrors`` rewrites those
answers on ``/v1/messages`` (and its ``/count_tokens``) only: it keeps the OpenAI object's fields
(``message``, ``param``, ``code``) and the status, adds the top-level
``"type": "error"`` and sets ``error.type`` to Anthropic's name for the status,
so the ``anthropic`` client raises its own exception class for it and an
OpenAI-minded reader still finds ``code`` and ``param``. It sits outside the
audit layer, which reads the original body's code.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MESSAGES_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
_MAX_ERROR_BODY = 64 * 1024  # larger is not one of our error objects: passed through

# Anthropic's error types by HTTP status (its API reference, "Errors").
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
          503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}  # fmt: skip


def anthropic_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def anthropic_error(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """An Anthropic error object that also carries the OpenAI one's ``code`` and ``param``."""
    return {"type": "error", "error": {"type": anthropic_type(status), "message": message, "param": param,
                                       "code": code}}  # fmt: skip


def rewrite(body: bytes, status: int) -> bytes:
    """``body`` (an OpenAI error object) in Anthropic's shape; unchanged when it is not one."""
    if len(body) > _MAX_ERROR_BODY:
        return body
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or payload.get("type") == "error":
        return body
    out = {"type": "error", "error": {**error, "type": anthropic_type(status)}}
    return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()


class AnthropicErrors:
    """Rewrites every JSON error answer of ``/v1/messages`` into Anthropic's shape (see the module)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in MESSAGES_PATHS:
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] = {"start": None, "body": b""}

        async def send_rewritten(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(raw=list(message.get("headers", [])))
                if message["status"] >= 400 and headers.get("content-type", "").startswith("application/json"):
                    held["start"] = message  # an error: held until its whole body is here
                    return
            elif message["type"] == "http.response.body" and held["start"] is not None:
                held["body"] += message.get("body", b"")
                if message.get("more_body", False):
                    return
                start, held["start"] = held["start"], None
                body = rewrite(held["body"], start["status"])
                headers = MutableHeaders(raw=list(start.get("headers", [])))
                headers["content-length"] = str(len(body))
                await send({**start, "headers": headers.raw})
                message = {**message, "body": body}
            await send(message)

        await self.app(scope, receive, send_rewritten)
