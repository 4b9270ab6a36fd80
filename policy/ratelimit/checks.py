"""What the limiter asks a backend, what it answers, and the sliding-window arithmetic.

A request becomes a list of ``Check``s, one per limit that applies (its
tenant's and its own): each names a counter, its limit and what the request
costs. A backend admits the request only if every check passes, and then
charges all of them, atomically.

Per-minute limits are sliding windows of ``buckets`` sub-windows (see
``policy.ratelimit.limiter`` for why not a token bucket). A counter at time
``now`` is the sum of the current bucket and the ``buckets`` before it: the
window is counted a little long (between ``window`` and ``window`` plus one
bucket), never short, so no interval of ``window`` seconds ever admits more
than the limit. The Redis script does the same arithmetic in Lua, in the same
order of floating-point operations, so both backends give identical answers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Protocol

# A period's quota counter outlives the period by this much, for late settlements.
QUOTA_GRACE_SECONDS: Final = 2 * 86400
# A slot frees whenever a running request ends; a denial suggests a short wait.
CONCURRENCY_RETRY_MS: Final = 1000


class Dimension(StrEnum):
    """What a check counts; the values are the ``Limits`` field names."""

    REQUESTS = "requests_per_minute"
    TOKENS = "tokens_per_minute"
    CONCURRENCY = "concurrent_requests"
    DAY = "tokens_per_day"
    MONTH = "tokens_per_month"
    SPEND = "spend_micros_per_month"
    BUDGET_TOKENS = "budget_tokens_per_month"

    @property
    def kind(self) -> str:
        """How it is counted: ``w`` sliding window, ``c`` concurrency leases, ``q`` period quota, ``b`` budget
        (a period counter like a quota's, which admits while it is below its limit: the crossing request runs)."""
        return _KINDS[self]  # a table: read about a dozen times per request


_KINDS: Final = {
    Dimension.REQUESTS: "w", Dimension.TOKENS: "w", Dimension.CONCURRENCY: "c", Dimension.DAY: "q",
    Dimension.MONTH: "q", Dimension.SPEND: "b", Dimension.BUDGET_TOKENS: "b",
}  # fmt: skip


class Level(StrEnum):
    TENANT = "tenant"
    KEY = "key"


@dataclass(frozen=True, slots=True)
class Check:
    """One counter a request must fit under."""

    dimension: Dimension
    level: Level
    key: str  # the counter's name, unique per (tenant, caller, dimension, window or period)
    limit: int
    cost: int  # 1 for a request or a slot; the estimated tokens for the token counters
    window: float = 0.0  # sliding windows: the window in seconds ...
    buckets: int = 0  # ... and how many sub-windows it is made of
    expires_at: float = 0.0  # quotas: the end of the period (epoch seconds)


@dataclass(frozen=True, slots=True)
class CheckResult:
    """A check's outcome, as the counter stood before this request was charged."""

    allowed: bool
    used: int
    retry_after_ms: int  # 0 if allowed; else until this counter alone would admit the request
    reset_ms: int  # until the counter is back to zero (OpenAI's x-ratelimit-reset-*)


class BackendUnavailable(Exception):
    """The backend cannot answer (Redis down or timing out); the limiter applies its failure mode."""


class Backend(Protocol):
    """Where counters live. Every method is one atomic step (one Redis round trip)."""

    async def reserve(
        self, checks: Sequence[Check], lease_id: str, lease_expires_at: float, now: float
    ) -> tuple[bool, list[CheckResult]]:
        """Admit and charge every check, or none; concurrency checks take a lease until ``lease_expires_at``."""
        ...

    async def settle(
        self, checks: Sequence[Check], lease_id: str, reserved_at: float, token_delta: int, now: float,
        spend_delta: int = 0,
    ) -> list[int]:
        """Correct token counters by ``token_delta`` (real minus estimate), the spend counters by ``spend_delta``;
        release the leases. Returns the budget (``b``) counters' values after the correction, in ``checks`` order."""
        ...

    async def renew(self, leases: Sequence[tuple[str, Sequence[Check]]], expires_at: float, now: float) -> None:
        """Extend running requests' leases (lease id, its checks) to ``expires_at``; an expired one stays so."""
        ...

    async def start(self) -> None:
        """Start background work (the memory backend's quota persistence)."""
        ...

    async def close(self) -> None: ...


# -- sliding-window arithmetic (mirrored by the Lua in policy.ratelimit.redis_backend)


def bucket_of(at: float, window: float, buckets: int) -> int:
    return math.floor(at / (window / buckets))


def bucket_expiry(index: int, window: float, buckets: int) -> float:
    """When bucket ``index`` stops counting."""
    return (index + buckets + 1) * (window / buckets)


def millis(seconds: float) -> int:
    return max(0, math.ceil(seconds * 1000))


def window_check(counts: Mapping[int, int], check: Check, now: float) -> tuple[CheckResult, int]:
    """Evaluate a sliding-window check on live ``counts`` (bucket index -> usage); also the current bucket."""
    current = bucket_of(now, check.window, check.buckets)
    oldest = current - check.buckets
    # One pass over the counters, on every request; they are sorted only to say when a refused one fits.
    used, newest = 0, None
    for index, count in counts.items():
        if index >= oldest:
            used += count
            if count > 0 and (newest is None or index > newest):
                newest = index
    allowed = used + check.cost <= check.limit
    retry = 0
    if allowed:
        pass
    elif check.cost > check.limit:
        retry = millis(check.window)  # never fits; say so with a full window
    else:
        need, released = used + check.cost - check.limit, 0
        for index, count in sorted((i, c) for i, c in counts.items() if i >= oldest):
            released += count
            if released >= need:
                retry = millis(bucket_expiry(index, check.window, check.buckets) - now)
                break
    return CheckResult(allowed, used, retry, window_reset(newest, check, now)), current


def window_reset(newest: int | None, check: Check, now: float) -> int:
    """Milliseconds until a window counter whose newest used bucket is ``newest`` is back at zero."""
    return 0 if newest is None else millis(bucket_expiry(newest, check.window, check.buckets) - now)
