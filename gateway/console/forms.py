"""What the console reads from a browser's request, and the refusals it answers with.

A form is urlencoded and bounded (``_MAX_FORM`` bytes, 64 fields; past either
it reads as empty); a form post must also come from this origin
(``same_origin``) and carry its CSRF token, else ``CsrfFailed`` (403). After
signing in the browser goes to a console path only (``safe_next``: no open
redirect). A data endpoint or a post without a session gets the API's 401
(``unauthenticated``), an unknown path the API's 404 (``no_route``).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl

from starlette.requests import Request
from starlette.responses import Response

from inferflux.gateway.context import get_context
from inferflux.gateway.errors import NotFound, render_error
from inferflux.policy.errors import ApiError, AuthenticationError, PolicyError

_MAX_FORM = 256 * 1024
_NEXT = re.compile(r"/console/[A-Za-z0-9/_.-]{0,500}")


class CsrfFailed(PolicyError):
    status_code = 403
    error_type = "permission_error"
    default_code = "csrf_failed"


def safe_next(value: str | None) -> str:
    """Where to go after signing in: a console path only (no open redirect)."""
    if value and _NEXT.fullmatch(value) and "//" not in value:
        return value
    return "/console/"


async def read_form(request: Request) -> dict[str, str]:
    """An urlencoded form (the console's forms are no more), bounded; the last of a repeated field."""
    body = await request.body()
    if len(body) > _MAX_FORM:
        return {}
    try:
        return dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True, max_num_fields=64))
    except (UnicodeDecodeError, ValueError):
        return {}


def same_origin(request: Request) -> bool:
    """An Origin header, when the browser sends one, names this host (SameSite=Strict already keeps the cookie home)."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    host = request.headers.get("host", "")
    return origin.split("://", 1)[-1] == host


def unauthenticated(request: Request) -> Response:
    error = AuthenticationError("Authentication is required: sign in at /console/login", code="missing_credentials")
    return render_error(error, get_context(request).request_id)


def no_route(request: Request) -> ApiError:
    return NotFound(f"No route for {request.method} {request.url.path}")
