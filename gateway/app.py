"""The ASGI application factory.

Middleware order, outermost first::

    RequestContextMiddleware   request id, the context later layers fill in
    MetricsMiddleware          status and latency per route template
    BodyLimitMiddleware        413 before a large body is read
    (authentication, rate limiting, guardrails slot in here, in that order)
    ExceptionMiddleware        GatewayError -> OpenAI-shaped JSON
    routes
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.context import RequestContextMiddleware, get_context
from gateway.errors import GatewayError, InternalError, MethodNotAllowed, NotFound, error_payload
from gateway.metrics import CLIENT_CLOSED_STATUS, GatewayMetrics, MetricsMiddleware, metrics_route
from gateway.middleware import BodyLimitMiddleware
from gateway.models import ModelManager
from gateway.routes import health, openai
from gateway.settings import Settings

log = logging.getLogger("inferflux.gateway")


async def _gateway_error(request: Request, exc: Exception) -> Response:
    return cast(GatewayError, exc).to_response(get_context(request).request_id)


async def _http_exception(request: Request, exc: Exception) -> Response:
    # Starlette raises these for unknown paths and wrong methods.
    http_exc = cast(HTTPException, exc)
    request_id = get_context(request).request_id
    if http_exc.status_code == 404:
        return NotFound(f"No route for {request.method} {request.url.path}").to_response(request_id)
    if http_exc.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}"
        return MethodNotAllowed(message, headers=http_exc.headers).to_response(request_id)
    error_type = "invalid_request_error" if http_exc.status_code < 500 else "server_error"
    headers = {**(http_exc.headers or {}), "x-request-id": request_id}
    return JSONResponse(
        error_payload(str(http_exc.detail), error_type), status_code=http_exc.status_code, headers=headers
    )


async def _client_disconnect(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_STATUS)


async def _unexpected(request: Request, exc: Exception) -> Response:
    ctx = get_context(request)
    log.error("unhandled error in request %s", ctx.request_id, exc_info=exc)
    return InternalError(f"Internal server error (request id {ctx.request_id})").to_response(ctx.request_id)


def create_app(settings: Settings, manager: ModelManager, *, owns_models: bool = True) -> Starlette:
    """Build the app serving ``manager``'s models.

    With ``owns_models`` the app shuts the engines down when it stops; tests
    that share one engine across apps pass False.
    """
    metrics = GatewayMetrics(manager)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.draining = False
        yield
        app.state.draining = True
        if owns_models:
            # Engine shutdown joins worker threads; keep the loop free meanwhile.
            await asyncio.to_thread(manager.shutdown)

    routes = [
        *openai.routes(),
        *health.routes(),
        Route("/metrics", metrics_route, methods=["GET"]),
    ]
    middleware = [
        Middleware(RequestContextMiddleware),
        Middleware(MetricsMiddleware, metrics=metrics),
        Middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            GatewayError: _gateway_error,
            HTTPException: _http_exception,
            ClientDisconnect: _client_disconnect,
            Exception: _unexpected,
        },
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.manager = manager
    app.state.metrics = metrics
    app.state.draining = False
    return app
