"""Which counters a caller's limits put on its requests, and the ``Check`` each becomes for one request.

Every limit that applies (the tenant's and the caller's own) is a counter:
per-minute requests and tokens (sliding windows), concurrent requests, and the
quotas of a calendar day or month (tokens, spend, a token budget). A counter's
key holds the tenant in braces (a Redis hash tag: a request's counters, all
its tenant's, share one cluster slot), the caller as a digest of its key id or
subject, and the window's shape; a quota's key also the period it counts,
named per request (``period_of``). The counters depend on the caller and its limits only, so
``Counters`` keeps them per caller, and each request just prices them.
"""

from __future__ import annotations

import functools
import hashlib
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

from inferflux.policy.bounded import remember
from inferflux.policy.ratelimit.checks import Check, Dimension, Level
from inferflux.policy.ratelimit.resolver import EffectiveLimits, Limits
from inferflux.policy.rbac import Principal

MAX_KNOWN_CALLERS = 10_000  # callers whose counters are kept (Counters._known)
_DAY = 86_400


class Counter(NamedTuple):
    """A counter a caller's requests are checked against; a ``Check`` once the request's cost is known."""

    dimension: Dimension
    level: Level
    key: str  # a quota's key without its period
    limit: int
    tokens: bool  # costs the request's estimated tokens (else one)
    window: float = 0.0
    buckets: int = 0
    quota: bool = False


def period_of(dimension: Dimension, now: float) -> tuple[str, float]:
    """The UTC calendar day or month containing ``now``: its name and its end (epoch seconds)."""
    return _period(dimension, int(now // _DAY))  # POSIX time has exactly 86,400 s in a day


@functools.lru_cache(maxsize=16)
def _period(dimension: Dimension, day: int) -> tuple[str, float]:
    at = datetime.fromtimestamp(day * _DAY, UTC)
    if dimension is Dimension.DAY:
        start = at.replace(hour=0, minute=0, second=0, microsecond=0)
        return start.strftime("%Y-%m-%d"), (start + timedelta(days=1)).timestamp()
    start = at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start.strftime("%Y-%m"), end.timestamp()


@functools.lru_cache(maxsize=4096)
def _subject_key(subject: str) -> str:
    """A caller's part of its counters' keys: bounded, and no odd characters in keys."""
    return hashlib.sha256(subject.encode()).hexdigest()[:32]


class Counters:
    """The counters of each caller, for windows of ``window_seconds`` in ``buckets`` sub-windows."""

    def __init__(self, window_seconds: float, buckets: int) -> None:
        self.window_seconds = window_seconds
        self.buckets = buckets
        self._known: dict[tuple[str, str, EffectiveLimits], tuple[Counter, ...]] = {}

    def checks(self, principal: Principal, limits: EffectiveLimits, estimated: int, cost: int, now: float) -> list[Check]:
        """One request's checks: ``estimated`` tokens (``cost`` micro-dollars on spend) on each of its counters."""
        out = []
        for counter in self.of(principal, limits):
            if counter.quota:
                period, end = period_of(counter.dimension, now)
                charge = cost if counter.dimension is Dimension.SPEND else estimated
                out.append(Check(counter.dimension, counter.level, f"{counter.key}:{period}", counter.limit,
                                 charge, expires_at=end))  # fmt: skip
            else:
                out.append(Check(counter.dimension, counter.level, counter.key, counter.limit,
                                 estimated if counter.tokens else 1, counter.window, counter.buckets))  # fmt: skip
        return out

    def of(self, principal: Principal, limits: EffectiveLimits) -> tuple[Counter, ...]:
        """The counters ``limits`` put on the caller: the same ones for every request of it, so kept."""
        own = principal.key_id or principal.subject
        found = self._known.get((principal.tenant_id, own, limits))
        if found is None:
            tenant = f"{{{principal.tenant_id}}}"
            found = (
                *self._level(Level.TENANT, limits.tenant, f"{tenant}:t"),
                *self._level(Level.KEY, limits.key, f"{tenant}:k:{_subject_key(own)}"),
            )
            remember(self._known, (principal.tenant_id, own, limits), found, MAX_KNOWN_CALLERS)
        return found

    def _level(self, level: Level, limits: Limits, base: str) -> list[Counter]:
        window = f"{self.window_seconds:g}x{self.buckets}"
        out: list[Counter] = []
        for dimension, name, tokens in (
            (Dimension.REQUESTS, f"rpm:{window}", False),
            (Dimension.TOKENS, f"tpm:{window}", True),
        ):
            limit = getattr(limits, dimension.value)
            if limit is not None:
                out.append(Counter(dimension, level, f"{base}:{name}", limit, tokens, self.window_seconds, self.buckets))
        if limits.concurrent_requests is not None:
            out.append(Counter(Dimension.CONCURRENCY, level, f"{base}:conc", limits.concurrent_requests, False))
        for dimension, name in ((Dimension.DAY, "quota"), (Dimension.MONTH, "quota"), (Dimension.SPEND, "spend"),
                                (Dimension.BUDGET_TOKENS, "budget")):  # fmt: skip
            limit = getattr(limits, dimension.value)
            if limit is not None:  # the key gets the period's name per request
                out.append(Counter(dimension, level, f"{base}:{name}", limit, True, quota=True))
        return out
