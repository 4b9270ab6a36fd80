"""Liveness and readiness probes.

``/livez`` answers whenever the event loop runs a handler at all; ``/readyz``
says whether this replica should get traffic: every configured model loaded,
its engine running, and the app not shutting down.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.models import ModelManager


async def livez(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def not_ready_reasons(request: Request) -> list[str]:
    manager: ModelManager = request.app.state.manager
    reasons = [f"model {name!r} is not loaded" for name in manager.missing()]
    if not len(manager):
        reasons.append("no model is loaded")
    for model in manager:
        if not model.engine.is_running:
            reasons.append(f"the engine of model {model.name!r} is not running")
    if getattr(request.app.state, "draining", False):
        reasons.append("the server is shutting down")
    return reasons


async def readyz(request: Request) -> Response:
    reasons = not_ready_reasons(request)
    if reasons:
        return JSONResponse({"status": "unavailable", "reasons": reasons}, status_code=503)
    return JSONResponse({"status": "ok"})


def routes() -> list[BaseRoute]:
    return [
        Route("/livez", livez, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]
