"""Every replica follows the store's model registry: the poll behind ``ModelAdmin.converge``.

The admin API's models live in the policy store (``served_models``), which all
replicas share. A model loaded, unloaded or made the default through one
replica reaches the others through this loop: it reads the store's
``policy_version`` every ``model_registry.poll_seconds`` (one small query; every
write to ``served_models`` bumps it) and, when it moved, or when this replica's
``ModelAdmin`` asks for another look (one of its loads ended), lets the admin
converge on the registry. So a change is seen within about one poll interval,
plus the model's own load time.

A store that cannot be reached does not stop the loop: the replica keeps
serving what it has, the loop says so once per outage (and once when it is
back), and it converges as soon as the store answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from inferflux.gateway.auth import call_store
from inferflux.policy.ratelimit.background import stop
from inferflux.policy.store import PolicyStore

log = logging.getLogger("inferflux.gateway.models.sync")


class RegistryPoller:
    """Runs ``converge(version)`` whenever the store's ``policy_version`` moves, or ``wanted()`` says so."""

    def __init__(
        self,
        store: PolicyStore,
        converge: Callable[[int], Awaitable[None]],
        wanted: Callable[[], bool],
        interval: float,
    ) -> None:
        self.store = store
        self.interval = interval
        self._converge = converge
        self._wanted = wanted
        self._seen: int | None = None  # the version last converged on; None: not yet (the first poll converges)
        self._failing = False  # inside an outage: its first failure is logged, the rest are not
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="model-registry-sync")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop(task)  # the limiter's background tasks stop the same way

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception as exc:  # a store outage, or a bug: keep serving, keep polling
                if not self._failing:
                    log.warning("cannot follow the model registry in the store (retrying every %.1f s): %s",
                                self.interval, getattr(exc, "message", None) or exc)  # fmt: skip
                self._failing = True
            else:
                if self._failing:
                    log.info("following the model registry in the store again")
                self._failing = False
            await asyncio.sleep(self.interval)

    async def poll(self) -> bool:
        """Converge if the registry may have changed since the last time; True if it converged."""
        version = await call_store(self.store.policy_version)
        if version == self._seen and not self._wanted():
            return False
        await self._converge(version)
        self._seen = version  # only once converged: a failed round is tried again at the next poll
        return True
