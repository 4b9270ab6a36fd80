"""Liveness and readiness probes.

``/readyz`` says whether this replica can serve new work now; 503 with the
reasons when it cannot: a configured model not loaded or its engine not
running, the server draining, the policy store unreachable for longer than
``store.stale_seconds``, the rate-limit backend down while limits fail closed,
or the audit spool unable to take events (failing, behind, disk below
``audit.min_free_bytes``). An orchestrator takes the replica out of rotation
and puts it back when the reasons clear. Model manifests in error
(``registry.path``) are listed under ``manifest_errors`` by file name, ready or
not: a bad manifest changes nothing that is served, so it never makes a
replica unready. While the store is unreachable within
its window, warm keys are still served, so the replica stays ready (200) and
says so under ``degraded``: 503 comes exactly when a warm key's chat would be
refused.

``/livez`` says whether the process should be restarted: 503 when an engine
thread has died (not when it was stopped by a shutdown). Everything else a
restart would not cure (a store or disk outage) is readiness, not liveness. A
wedged event loop cannot answer at all, which the probe's timeout catches.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from inferflux.gateway.models.served import ModelManager


def _draining(request: Request) -> bool:
    drain = getattr(request.app.state, "drain", None)
    return drain is not None and drain.draining


def _dead_engines(request: Request) -> list[str]:
    manager: ModelManager = request.app.state.manager
    return [model.name for model in manager if not model.engine.is_running]


async def livez(request: Request) -> Response:
    dead = [] if _draining(request) else _dead_engines(request)
    if dead:
        reasons = [f"the engine of model {name!r} has stopped" for name in dead]
        return JSONResponse({"status": "unavailable", "reasons": reasons}, status_code=503)
    return JSONResponse({"status": "ok"})


def not_ready_reasons(request: Request) -> list[str]:
    manager: ModelManager = request.app.state.manager
    reasons = [f"model {name!r} is not loaded" for name in manager.missing()]
    if not len(manager):
        reasons.append("no model is loaded")
    reasons += [f"the engine of model {name!r} is not running" for name in _dead_engines(request)]
    if _draining(request):
        reasons.append("the server is shutting down")
    snapshot = getattr(request.app.state, "snapshot", None)
    if snapshot is not None and snapshot.expired:
        reasons.append(f"the policy store has been unreachable for {snapshot.age:.0f} s "
                       f"(cached decisions serve for {snapshot.stale_seconds:.0f} s)")  # fmt: skip
    audit = getattr(request.app.state, "audit_health", None)
    spool_reason = audit.reason() if audit is not None else None
    if spool_reason is not None:
        reasons.append(f"the audit spool cannot take events ({spool_reason})")
    return reasons


def degraded(request: Request) -> list[str]:
    """What this replica serves from a snapshot while ready: the store unreachable within its window."""
    snapshot = getattr(request.app.state, "snapshot", None)
    if snapshot is None or not snapshot.serving_stale or snapshot.expired:
        return []
    return [f"the policy store is unreachable: keys and policies already cached are served from a snapshot "
            f"{snapshot.age:.0f} s old, for up to {snapshot.stale_seconds:.0f} s (store.stale_seconds); "
            "credentials and tenants not cached get 503"]  # fmt: skip


def manifest_errors(request: Request) -> dict[str, str]:
    """The model manifests in error, by file name (``gateway.models.manifests``): reported, never a reason to be
    unready, since a bad manifest changes nothing that is served."""
    watcher = getattr(request.app.state, "manifests", None)
    return watcher.errors() if watcher is not None else {}


async def readyz(request: Request) -> Response:
    reasons = not_ready_reasons(request)
    limiter = getattr(request.app.state, "limiter", None)
    down = await limiter.unavailable() if limiter is not None else None
    if down is not None:
        reasons.append(f"the rate-limit backend is unreachable and limits fail closed ({down})")
    manifests = manifest_errors(request)
    detail = {"manifest_errors": manifests} if manifests else {}
    if reasons:
        return JSONResponse({"status": "unavailable", "reasons": reasons, **detail}, status_code=503)
    serving_stale = degraded(request)
    if serving_stale:
        return JSONResponse({"status": "ok", "degraded": serving_stale, **detail})
    return JSONResponse({"status": "ok", **detail})


def routes() -> list[BaseRoute]:
    return [
        Route("/livez", livez, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]
