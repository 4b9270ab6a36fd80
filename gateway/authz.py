"""Route-level authorization: each endpoint names the scope it requires.

``requires(scope)`` wraps an endpoint so it runs only for a principal holding
that scope, and records the scope on the endpoint so tests and the OpenAPI
document can list what every route demands.

Before the scope, tenancy: a request naming another tenant (path or
``tenant_id`` query) answers 404 to anyone but a platform admin, and a
platform-only route answers non-platform callers as if it did not exist
(404), except on their own tenant's path, where the 403 tells nothing new. An endpoint reached without a
principal (authentication not installed, or a public path by mistake) is
refused: default deny.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from inferflux.gateway.context import get_context
from inferflux.gateway.audit import changes_admin_state, record_attempt
from inferflux.policy.errors import AuthenticationError, NotFound
from inferflux.policy.rbac import Principal, Scope

Endpoint = Callable[[Request], Awaitable[Response]]

SCOPE_ATTR = "required_scope"


def principal_of(request: Request) -> Principal:
    principal = get_context(request).principal
    if not isinstance(principal, Principal):
        raise AuthenticationError("Authentication is required", code="missing_credentials")
    return principal


def refuse_outside_tenant(request: Request, principal: Principal) -> None:
    """404 for a request that names a tenant other than the caller's (in the path or the
    ``tenant_id`` query), for anyone but a platform admin: the same answer whether that
    tenant exists or not, and before any scope is checked, so no 403 tells that it does."""
    named = request.path_params.get("tenant_id")
    if named is None and request.url.path.startswith("/admin/"):  # the OpenAI routes take no tenant
        named = request.query_params.get("tenant_id")
    if named is not None:
        principal.require_tenant(named)


def refuse_platform_route(request: Request, principal: Principal, scope: Scope) -> None:
    """A platform-only route is, to everyone else, a route that does not exist (the router's own 404)."""
    if scope is Scope.ADMIN_PLATFORM and not principal.has(scope):
        names_own_tenant = request.path_params.get("tenant_id") == principal.tenant_id
        if not names_own_tenant:
            raise NotFound(f"No route for {request.method} {request.url.path}")


def requires(scope: Scope) -> Callable[[Endpoint], Endpoint]:
    def decorate(endpoint: Endpoint) -> Endpoint:
        @functools.wraps(endpoint)
        async def guarded(request: Request) -> Response:
            principal = principal_of(request)
            refuse_outside_tenant(request, principal)
            refuse_platform_route(request, principal, scope)
            principal.require(scope)
            if changes_admin_state(request):
                await record_attempt(request, principal)
            return await endpoint(request)

        setattr(guarded, SCOPE_ATTR, scope)
        return guarded

    return decorate
