"""The ASGI application factory.

Middleware order, outermost first::

    RequestContextMiddleware   request id, the context later layers fill in; the request's trace span (gateway.tracing)
    AnthropicErrors            /v1/messages: every error body in Anthropic's shape (gateway.pipeline.adapters.errors)
    AuditMiddleware            one audit event per /v1 call, on disk before the answer
    MetricsMiddleware          status and latency per route template
    ServiceGate                503 while draining, or while the audit spool cannot take events
    AuthMiddleware             401 unless the credentials prove a principal
    BodyLimitMiddleware        413 before a large body is read
    BodyDeadlineMiddleware     408 when the body is not in within input_limits.body_timeout_seconds
    (generation routes then apply guardrails, OPA and rate limits: gateway.pipeline.policy)
    ExceptionMiddleware        ApiError (GatewayError, PolicyError) -> OpenAI-shaped JSON
    routes                     each requires its scope (gateway.authz)

Only /livez, /readyz and /metrics answer without credentials; /console
(gateway.console) signs its users in itself and calls the admin routes for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, cast

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from inferflux.backends.engine.grammar_sandbox import shared_sandbox

from inferflux.gateway.pipeline.adapters import AnthropicErrors
from inferflux.gateway.auth import PUBLIC_PATHS, AuthMiddleware, Authenticator
from inferflux.gateway.authz import requires
from inferflux.gateway.console import Console, SignInThrottle
from inferflux.gateway.context import RequestContextMiddleware, get_context
from inferflux.gateway.errors import InternalError, MethodNotAllowed, NotFound, error_payload, render_error
from inferflux.gateway.metrics import CLIENT_CLOSED_STATUS, GatewayMetrics, MetricsMiddleware, metrics_route
from inferflux.gateway.logs import redaction as log_redaction
from inferflux.gateway.audit import AuditMiddleware
from inferflux.gateway.drain import Drain
from inferflux.gateway.gate import AuditHealth, ServiceGate
from inferflux.gateway.middleware import BodyLimitMiddleware
from inferflux.gateway.slowclients import BodyDeadlineMiddleware
from inferflux.gateway.state import GatewayState
from inferflux.gateway.tracing import Tracing
from inferflux.gateway.traffic import TrafficPolicy
from inferflux.gateway.models.admin import ModelAdmin
from inferflux.gateway.models.manifests import ManifestWatcher
from inferflux.gateway import VERSION
from inferflux.gateway.models.served import ModelManager
from inferflux.gateway.openapi import document, openapi_route
from inferflux.gateway.routes import admin, health, openai
from inferflux.gateway import websocket
from inferflux.gateway.settings import Settings
from inferflux.policy.errors import ApiError
from inferflux.policy.rbac import Scope
from inferflux.policy.snapshot import StoreSnapshot
from inferflux.policy.store import PolicyStore

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("inferflux.gateway")


async def _api_error(request: Request, exc: Exception) -> Response:
    return render_error(cast(ApiError, exc), get_context(request).request_id)


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


# Starlette's exception handlers, by the exception they answer (the most specific class wins).
EXCEPTION_HANDLERS = {
    ApiError: _api_error,
    HTTPException: _http_exception,
    ClientDisconnect: _client_disconnect,
    Exception: _unexpected,
}


def create_app(
    settings: Settings,
    manager: ModelManager,
    *,
    store: PolicyStore | None = None,
    owns_store: bool | None = None,
    authenticator: Authenticator | None = None,
    traffic: TrafficPolicy | None = None,
    owns_models: bool = True,
    configured_models: set[str] | None = None,
    span_exporter: SpanExporter | None = None,
) -> Starlette:
    """Build the app serving ``manager``'s models, guarded by ``store``'s policies.

    Without ``store`` the app opens the one ``settings`` names. It closes the
    store when it stops if it opened it, or if ``owns_store`` says so. With
    ``owns_models`` the app shuts the engines down when
    it stops; tests that share one engine across apps pass False.
    ``configured_models`` names the models from the configuration, which the
    admin API may not unload (default: those in ``manager`` now). With
    ``tracing.enabled``, ``span_exporter`` replaces the exporters the OTEL_*
    variables name (tests pass an in-memory one).
    """
    log_redaction.install()  # tests and embedders serve the app without ``serve``'s logging setup
    if owns_store is None:
        owns_store = store is None
    if store is None:
        store = PolicyStore.open(settings.store, settings.data_dir)
    if authenticator is None:
        authenticator = _authenticator(settings, store)
    # One clock for every cache of store decisions: how long they may serve while the store is down.
    snapshot = authenticator.snapshot
    metrics = GatewayMetrics(manager)
    if traffic is None:
        traffic = TrafficPolicy.build(
            settings, store, on_limiter_failure=metrics.observe_limiter_failure, snapshot=snapshot
        )
    # One store read per poll interval tells authentication, limits and guardrails whether policy moved.
    authenticator.on_version(traffic.observe_policy_version)
    model_admin = ModelAdmin(
        manager, store, settings, configured_models if configured_models is not None else {m.name for m in manager}
    )

    audit_health = AuditHealth()
    _watch(metrics, snapshot, audit_health)
    shared_sandbox().resize(settings.grammar.workers)  # the process's grammar workers (gateway.pipeline.grammars)
    tracing = Tracing.build(settings.tracing, exporter=span_exporter)  # None: off
    app = Starlette(
        routes=_routes(settings, store, authenticator, metrics),
        middleware=_middleware(settings, tracing, metrics, authenticator, audit_health),
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=_lifespan(owns_models=owns_models, owns_store=owns_store, tracing=tracing),
    )
    app.state = _gateway_state(settings, manager, metrics, store, authenticator, model_admin, traffic, audit_health)
    if settings.registry.path is not None:
        app.state.manifests = ManifestWatcher(model_admin, settings.registry, settings.server.shutdown_grace_seconds)
        metrics.labelled_gauge("inferflux_registry_manifest_errors",
                               "1 for each model manifest in error (registry.path), by file name",
                               "file", lambda: dict.fromkeys(app.state.manifests.errors(), 1.0))  # fmt: skip
    return app


def _gateway_state(settings: Settings, manager: ModelManager, metrics: GatewayMetrics, store: PolicyStore,
                   authenticator: Authenticator, model_admin: ModelAdmin, traffic: TrafficPolicy,
                   audit_health: AuditHealth) -> GatewayState:  # fmt: skip
    """The app's typed state: the parts ``create_app`` built, and the limits the settings imply, made once."""
    return GatewayState(
        settings=settings,
        manager=manager,
        metrics=metrics,
        store=store,
        authenticator=authenticator,
        model_admin=model_admin,
        traffic=traffic,
        snapshot=authenticator.snapshot,
        audit_health=audit_health,
        drain=Drain(),
        json_limits=settings.input_limits.json_limits(),
        store_json_limits=settings.input_limits.json_limits(allow_nul=False),
        stop_limits=settings.input_limits.stop_limits(),
        schema_limits=settings.input_limits.schema_limits(),
        grammar_budget=settings.grammar.budget(),
    )


def _authenticator(settings: Settings, store: PolicyStore) -> Authenticator:
    auth = settings.auth
    return Authenticator(
        store,
        cache_ttl=auth.cache_ttl_seconds,
        poll_interval=auth.revocation_poll_seconds,
        flush_interval=auth.last_used_flush_seconds,
        snapshot=StoreSnapshot(settings.store.stale_seconds),
    )


def _routes(settings: Settings, store: PolicyStore, authenticator: Authenticator,
            metrics: GatewayMetrics) -> list[BaseRoute]:  # fmt: skip
    """The API's routes, the probes, /metrics and /openapi.json; the console's when it is enabled."""
    openapi = document("This document", tag="meta")(requires(Scope.READ)(openapi_route("InferFlux", VERSION)))
    routes: list[BaseRoute] = [
        *openai.routes(),
        *admin.routes(),
        *health.routes(),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    if settings.websocket.enabled:
        routes += websocket.routes()
    if settings.console.enabled:
        throttle = SignInThrottle(settings.console.sign_in_failures, settings.console.sign_in_window_seconds)
        console = Console(store, authenticator, metrics, lifetime=settings.console.session_seconds,
                          idle=settings.console.idle_seconds, throttle=throttle)  # fmt: skip
        routes.append(console.mount())
    return routes


def _middleware(settings: Settings, tracing: Tracing | None, metrics: GatewayMetrics, authenticator: Authenticator,
                audit_health: AuditHealth) -> list[Middleware]:  # fmt: skip
    """The middleware in the module docstring's order, outermost first."""
    return [
        Middleware(RequestContextMiddleware, tracing=tracing),
        Middleware(AnthropicErrors),
        Middleware(AuditMiddleware),
        Middleware(MetricsMiddleware, metrics=metrics),
        Middleware(ServiceGate, exempt=PUBLIC_PATHS, audit=audit_health),
        Middleware(AuthMiddleware, authenticator=authenticator, public_paths=PUBLIC_PATHS,
                   console=settings.console.enabled),
        Middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes),
        Middleware(BodyDeadlineMiddleware, seconds=settings.input_limits.body_timeout_seconds),
    ]


def _lifespan(*, owns_models: bool, owns_store: bool,
              tracing: Tracing | None) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:  # fmt: skip
    """The app's start (authentication's and the traffic policy's tasks, the registry's follower) and its
    stop, in reverse; the engines and the store stopped only where the app owns them."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state: GatewayState = app.state
        state.drain = Drain()  # one per run: its events belong to this loop
        await state.authenticator.start()
        state.audit_trail = state.audit_health.trail = await state.traffic.start()
        state.model_admin.start()  # follows the store's model registry: other replicas' loads, unloads, default
        if state.manifests is not None:
            state.manifests.start()  # and registry.path's manifests
        try:
            yield
        finally:
            state.drain.draining = True
            if state.manifests is not None:
                await state.manifests.stop()
            await state.model_admin.aclose()
            await state.traffic.close()
            await state.authenticator.stop()
            if owns_models:
                # Engine shutdown joins worker threads; keep the loop free meanwhile.
                await asyncio.to_thread(state.manager.shutdown)
            if owns_store:
                await asyncio.to_thread(state.store.close)
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)  # exports the spans still buffered
            await asyncio.to_thread(shared_sandbox().close)  # the idle grammar workers; a busy one ends with its check

    return lifespan


def _watch(metrics: GatewayMetrics, snapshot: StoreSnapshot, audit: AuditHealth) -> None:
    """Gauges for the degraded modes: how stale the policy decisions are, how the audit spool's disk is."""
    metrics.gauge("inferflux_policy_snapshot_age_seconds",
                  "Seconds since the policy store was last read successfully", lambda: snapshot.age)
    metrics.gauge("inferflux_policy_serving_stale",
                  "1 while the store is unreachable and cached decisions serve (store.stale_seconds)",
                  lambda: float(snapshot.serving_stale))
    metrics.gauge("inferflux_audit_spool_free_bytes",
                  "Free bytes on the audit spool's file system", audit.free_bytes)
    metrics.gauge("inferflux_grammar_workers", "Grammar worker processes running (grammar.workers at most)",
                  lambda: float(shared_sandbox().snapshot()["workers"]))
    metrics.gauge("inferflux_grammar_over_budget", "New grammars stopped over their budget so far (400 schema_too_complex)",
                  lambda: float(shared_sandbox().snapshot()["over_budget"]))
    metrics.gauge("inferflux_audit_spool_healthy",
                  "0 while new work is refused because the audit spool cannot take events",
                  lambda: float(audit.reason() is None))  # fmt: skip
