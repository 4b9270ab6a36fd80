"""The WebSocket front door's messages: what a client may send, and the events the server sends back.

A client sends one JSON object per message::

    {"id": "r1", "type": "chat.completions", "body": {...}}   a request: the HTTP route's body (streamed)
    {"id": "r1", "type": "cancel"}                            ends request r1 as a client disconnect would

and gets events that each carry the id of the request they belong to::

    {"id": "r1", "type": "chunk", "data": {...}}   what the SSE stream's ``data:`` line would carry
    {"id": "r1", "type": "done", "request_id": ...}             the stream's ``[DONE]``
    {"id": "r1", "type": "error", "status": 404, "error": {...}, "request_id": ...}
    {"id": "r1", "type": "cancelled", "request_id": ...}        after a cancel

An error's ``status`` is what the HTTP route would have answered; ``error`` is OpenAI's
error object. A message that cannot be read (not JSON, too large, no id) gets an error
event with the id it named, or ``null``. Nothing here closes the connection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from inferflux.gateway.errors import InvalidRequest, MalformedJSON, RequestTooLarge, error_body
from inferflux.policy.errors import ApiError

# The request types, by the HTTP route each runs through.
ROUTES = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions"}
CANCEL = "cancel"
MAX_ID_CHARS = 128


@dataclass(frozen=True)
class Message:
    """A client message read: a request (``path`` and its JSON ``body``) or a cancel (``path`` None)."""

    id: str
    path: str | None
    body: bytes = b""


class BadMessage(Exception):
    """A message refused before it runs; ``id`` is the one it named, if it named one it could."""

    def __init__(self, error: ApiError, id: str | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.id = id


def parse_message(text: str | bytes, max_bytes: int) -> Message:
    """``text`` as a request or a cancel; BadMessage (413 or 400) when it is neither."""
    if len(text) > max_bytes or (isinstance(text, str) and len(text.encode()) > max_bytes):
        raise BadMessage(RequestTooLarge(f"The message exceeds the limit of {max_bytes} bytes"))
    try:
        decoded = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        raise BadMessage(MalformedJSON("The message is not valid JSON")) from None
    if not isinstance(decoded, dict):
        raise BadMessage(MalformedJSON("The message must be a JSON object"))
    id = decoded.get("id")
    if not isinstance(id, str) or not 0 < len(id) <= MAX_ID_CHARS or not id.isprintable():
        raise BadMessage(InvalidRequest(f"id: a string of 1 to {MAX_ID_CHARS} printable characters is required",
                                        param="id", code="invalid_id"))  # fmt: skip
    kind = decoded.get("type")
    if kind == CANCEL:
        return Message(id, None)
    if kind not in ROUTES:
        known = ", ".join([*ROUTES, CANCEL])
        raise BadMessage(InvalidRequest(f"type: one of {known}", param="type", code="unknown_type"), id)
    body = decoded.get("body")
    if not isinstance(body, dict):
        raise BadMessage(InvalidRequest("body: the request's JSON object is required", param="body"), id)
    # Streamed, always: every answer comes back as events.
    return Message(id, ROUTES[kind], json.dumps({**body, "stream": True}).encode())


def error_event(id: str | None, error: ApiError, request_id: str | None = None) -> dict[str, Any]:
    return {"id": id, "type": "error", "status": error.status_code, **error_body(error), "request_id": request_id}
