"""The console's one way to read or change anything: a call of the admin API's own route, in process.

A console page or form does not reimplement a resource: it builds the admin API
request the same action would be over HTTP (``/admin/v1/...``, a JSON body) and
runs it through the app's router with the console caller's principal on the
request context. The route's ``@requires`` (scope, another tenant's 404, the
platform-only 404), its pydantic body, its store calls and its audit records
(``record_attempt``, ``record_change``) are the API's, so an answer and its
validation are the API's by construction. The exception handlers the app
installed for this request render an ``ApiError`` as the API would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import Message

from inferflux.gateway.errors import error_payload

API_PREFIX = "/admin/v1"
# Starlette's ExceptionMiddleware puts the app's handlers here; a route call reads them from its scope.
_HANDLERS_KEY = "starlette.exception_handlers"
_PASSED = ("inferflux.context", _HANDLERS_KEY, "app", "server", "client", "scheme", "http_version", "root_path")


@dataclass(frozen=True)
class ApiAnswer:
    status: int
    body: bytes
    content_type: str

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
        if not self.body or not self.content_type.startswith("application/json"):
            return None
        return json.loads(self.body)

    @property
    def error(self) -> dict[str, Any]:
        """The OpenAI-shaped error's fields (message, code, param), or an empty dict."""
        data = self.json()
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return data["error"]
        return {}


def api_path(*parts: str) -> str:
    """``/admin/v1/<parts>``, each part percent-encoded (a path segment from a URL or a form)."""
    return API_PREFIX + "".join("/" + quote(p, safe="") for p in parts)


async def call_api(
    request: Request, method: str, path: str, body: Any = None, query: dict[str, str] | None = None,
    *, raw: bytes | None = None
) -> ApiAnswer:
    """Run ``method path`` (an admin API path) with ``body`` as JSON (or ``raw``, a form's JSON text as typed) through the app's routes; the answer.

    ``request`` is the console request whose context (principal, request id)
    the call runs under. The path must be the API's: anything outside
    ``/admin/v1/`` is refused here rather than routed.
    """
    if not path.startswith(API_PREFIX + "/"):
        raise ValueError(f"not an admin API path: {path!r}")
    if raw is None:
        raw = b"" if body is None else json.dumps(body).encode()
    scope: dict[str, Any] = {k: request.scope[k] for k in _PASSED if k in request.scope}
    scope.update(
        type="http",
        method=method,
        path=path,
        raw_path=path.encode(),
        query_string=urlencode(query or {}).encode(),
        headers=[(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
    )
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    status, content_type, chunks = 500, "", []

    async def send(message: Message) -> None:
        nonlocal status, content_type
        if message["type"] == "http.response.start":
            status = message["status"]
            for name, value in message.get("headers", ()):
                if name.lower() == b"content-type":
                    content_type = value.decode("latin-1")
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await request.scope["app"].router(scope, receive, send)
    except HTTPException as exc:  # the router's own 404 and 405: no route of the API has this path
        message = f"No route for {method} {path}" if exc.status_code == 404 else str(exc.detail)
        data = error_payload(message, "invalid_request_error", code="not_found" if exc.status_code == 404 else None)
        return ApiAnswer(exc.status_code, json.dumps(data).encode(), "application/json")
    return ApiAnswer(status, b"".join(chunks), content_type)
