"""The console's live panel: each model's queue, running sequences, KV blocks and tokens per second.

One server-sent event a second for ``LIVE_SECONDS`` (the browser's EventSource
reconnects after it), or until the replica drains; a caller sees only the
models its principal may use. Tokens per second are read off the completion
tokens counter (``GatewayMetrics.completion_tokens``) between two events.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from inferflux.gateway.metrics import GatewayMetrics
from inferflux.gateway.state import GatewayState

LIVE_SECONDS = 300.0


async def live_events(state: GatewayState, metrics: GatewayMetrics,
                      allowed: frozenset[str] | None) -> AsyncIterator[bytes]:  # fmt: skip
    """The panel's events as SSE ``data:`` lines; ``allowed`` the models shown (None: every one)."""
    end = time.monotonic() + LIVE_SECONDS
    last, last_at = _tokens(metrics), time.monotonic()
    while time.monotonic() < end and not state.drain.draining:
        now, tokens = time.monotonic(), _tokens(metrics)
        rate = {m: (tokens.get(m, 0.0) - last.get(m, 0.0)) / max(now - last_at, 1e-3) for m in tokens}
        last, last_at = tokens, now
        models = []
        for model in state.manager:
            if allowed is not None and model.name not in allowed:
                continue
            stats = model.engine.stats()
            models.append({"model": model.name, "waiting": stats.num_waiting, "running": stats.num_running,
                           "kv_used": stats.num_blocks_used, "kv_free": stats.num_blocks_free,
                           "tokens_per_second": round(rate.get(model.name, 0.0), 2)})  # fmt: skip
        yield f"data: {json.dumps({'at': time.time(), 'models': models})}\n\n".encode()
        await asyncio.sleep(1.0)


def _tokens(metrics: GatewayMetrics) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in metrics.completion_tokens.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[sample.labels["model"]] = sample.value
    return out
