"""Helpers of the rate-limit tests (a module name of its own: every test directory has a conftest)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from inferflux.policy.ratelimit import RateLimiter
from inferflux.policy.rbac import Principal

# In the future, so that absolute Redis expiries (quota counters) lie ahead of
# the real clock; one hour before both a day and a month (and a year) end.
BASE = datetime(2030, 12, 31, 23, 0, tzinfo=UTC).timestamp()


class FakeClock:
    """Epoch seconds that move only when told."""

    def __init__(self, now: float = BASE) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


LimiterFactory = Callable[..., RateLimiter]
PrincipalFactory = Callable[..., Principal]
