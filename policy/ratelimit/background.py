"""The rate limiter's periodic background work (quota persistence, lease renewal)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("inferflux.policy.ratelimit")


async def every(interval: float, work: Callable[[], Awaitable[object]], what: str) -> None:
    """Run ``work`` every ``interval`` seconds until cancelled; a failed round is logged, not fatal."""
    while True:
        await asyncio.sleep(interval)
        try:
            await work()
        except Exception:  # a full disk or a Redis blip now must not end the work for good
            log.exception("%s failed; trying again in %.1f s", what, interval)


async def stop(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
