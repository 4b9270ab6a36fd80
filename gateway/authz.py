"""Route-level authorization: each endpoint names the scope it requires.

``requires(scope)`` wraps an endpoint so it runs only for a principal holding
that scope, and records the scope on the endpoint so tests and the OpenAPI
document can list what every route demands. An endpoint reached without a
principal (authentication not installed, or a public path by mistake) is
refused: default deny.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.context import get_context
from policy.errors import AuthenticationError
from policy.rbac import Principal, Scope

Endpoint = Callable[[Request], Awaitable[Response]]

SCOPE_ATTR = "required_scope"


def principal_of(request: Request) -> Principal:
    principal = get_context(request).principal
    if not isinstance(principal, Principal):
        raise AuthenticationError("Authentication is required", code="missing_credentials")
    return principal


def requires(scope: Scope) -> Callable[[Endpoint], Endpoint]:
    def decorate(endpoint: Endpoint) -> Endpoint:
        @functools.wraps(endpoint)
        async def guarded(request: Request) -> Response:
            principal_of(request).require(scope)
            return await endpoint(request)

        setattr(guarded, SCOPE_ATTR, scope)
        return guarded

    return decorate
