"""``GET /admin/v1/status``: this replica's state at a glance (any credential that reads), for ``inferctl status``.

What ``/readyz`` says (ready, and the reasons when not), the version, and
per model the engine's figures that ``/metrics`` exports as gauges: queued
and running sequences, KV blocks in use. A caller sees only the models it
may use (as ``/v1/models``); the figures are the engine's totals, never
split by tenant, so no tenant learns another's traffic from them.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from inferflux.gateway import VERSION
from inferflux.gateway.authz import principal_of, requires
from inferflux.gateway.models.served import ServedModel
from inferflux.gateway.openapi import document
from inferflux.gateway.routes.admin.common import PREFIX, ok
from inferflux.gateway.routes.health import not_ready_reasons
from inferflux.gateway.state import state_of
from inferflux.policy.rbac import Scope

log = logging.getLogger("inferflux.gateway.admin")


def _model_status(model: ServedModel, default: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": model.name, "backend": model.backend, "default": model.name == default,
                           "running": bool(model.engine.is_running)}  # fmt: skip
    try:
        stats = model.engine.stats()
    except Exception:  # a broken engine must not break the whole answer: its figures are left out
        log.exception("reading stats of %s failed", model.name)
        return out
    return {
        **out,
        "running_sequences": stats.num_running,
        "waiting_sequences": stats.num_waiting + stats.num_waiting_embeddings,
        "kv_blocks_used": stats.num_blocks_used,
        "kv_blocks_total": stats.num_blocks_total,
        "kv_usage": round(stats.kv_cache_usage, 4),
        # Of the slots in the blocks in use, the share holding computed KV (BlockManager.kv_slots).
        "kv_slot_utilisation": round(stats.kv_slot_utilisation, 4),
        "tokens_generated": stats.num_tokens_generated,
    }


@document("This replica's readiness, version and per-model queue, running sequences and KV use", tag="admin")
@requires(Scope.READ)
async def status(request: Request) -> Response:
    principal = principal_of(request)
    manager = state_of(request).manager
    default = manager.default_name
    models = [_model_status(m, default) for m in manager.list() if principal.may_use_model(m.name)]
    reasons = not_ready_reasons(request)
    limiter = getattr(request.app.state, "limiter", None)
    down = await limiter.unavailable() if limiter is not None else None
    if down is not None:
        reasons.append(f"the rate-limit backend is unreachable and limits fail closed ({down})")
    return ok({
        "object": "status",
        "version": VERSION,
        "ready": not reasons,
        "reasons": reasons,
        "queue_depth": sum(m.get("waiting_sequences", 0) for m in models),
        "running_sequences": sum(m.get("running_sequences", 0) for m in models),
        "models": models,
    })  # fmt: skip


def routes() -> list[BaseRoute]:
    return [Route(PREFIX + "/status", status, methods=["GET"])]
