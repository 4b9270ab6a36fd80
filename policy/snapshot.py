"""How old the policy decisions held in memory are, and whether they may still be served.

Authentication, rate limits and guardrails each cache what they read from the
policy store and re-read it when the store's ``policy_version`` moves. When the
store cannot be reached those caches are all the gateway has: a *stale
snapshot*. ``StoreSnapshot`` is the one clock they share. Every successful
store read calls ``fresh()``, every failed one ``failed()``; while the last
success is at most ``stale_seconds`` old, a cached decision keeps serving
(``may_serve_stale``); beyond that the gateway refuses work that depends on the
store (503) and says it is not ready. A decision never cached (a key never
seen) cannot be served from a snapshot at all.

Why a bound: a revocation or a lowered limit made during the outage cannot
reach this replica until the store is back, so the window is how long an
operator accepts decisions that may be that old (default five minutes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("inferflux.policy.snapshot")

DEFAULT_STALE_SECONDS = 300.0
LOG_EVERY_SECONDS = 10.0


class StoreSnapshot:
    """Shared by every cache of store decisions in one process; thread-safe (the resolvers run on threads)."""

    def __init__(
        self,
        stale_seconds: float = DEFAULT_STALE_SECONDS,
        *,
        clock: Callable[[], float] = time.monotonic,
        log_every: float = LOG_EVERY_SECONDS,
    ) -> None:
        self.stale_seconds = stale_seconds
        self._clock = clock
        self._log_every = log_every
        self._lock = threading.Lock()
        self._ok_at = clock()
        self._failing = False
        self._logged_at = float("-inf")

    def fresh(self) -> None:
        """A store read succeeded: what is cached now matches the store."""
        with self._lock:
            recovered = self._failing
            self._ok_at = self._clock()
            self._failing = False
        if recovered:
            log.warning("policy store reachable again; decisions are fresh")

    def failed(self) -> None:
        """A store read failed: cached decisions are now a snapshot getting older."""
        with self._lock:
            self._failing = True

    @property
    def age(self) -> float:
        """Seconds since the store was last read successfully."""
        return max(0.0, self._clock() - self._ok_at)

    @property
    def serving_stale(self) -> bool:
        """The last store read failed: cached decisions are being served as a snapshot."""
        return self._failing

    @property
    def expired(self) -> bool:
        """The store has been unreachable longer than the window: no cached decision may serve."""
        return self._failing and self.age > self.stale_seconds

    def may_serve_stale(self) -> bool:
        """Whether a cached decision may answer while the store is unreachable (logs, rate-limited, if so)."""
        age = self.age
        if age > self.stale_seconds:
            return False
        now = self._clock()
        with self._lock:
            due = now - self._logged_at >= self._log_every
            if due:
                self._logged_at = now
        if due:
            log.warning(
                "policy store unreachable: serving decisions from a stale snapshot %.0f s old "
                "(refused after %.0f s; store.stale_seconds)", age, self.stale_seconds,
            )
        return True
