"""``RateLimiter``: admit a request against its limits before it runs, settle its real usage after.

    admission = await limiter.check_and_reserve(principal, prompt_tokens=n, max_tokens=m)
    if isinstance(admission, Denial):
        raise admission.error()                  # 429, OpenAI-shaped, with its headers
    try:
        ... generate, stream ...
    finally:
        await limiter.settle(admission.handle, prompt_tokens, completion_tokens)

A request is checked, and charged, against every limit that applies to it (its
tenant's and its own: ``policy.ratelimit.counters``): one request on the
request counters, its *estimated* tokens (prompt + ``max_tokens``, or
``completion_estimate`` without one) on the token and quota counters, and a
concurrency slot. ``settle`` replaces the
estimate by the real count (for a stream, what was generated, also when the
client went away) and frees the slot.

**Why a sliding window and not a token bucket (or GCRA).** A bucket that
allows a burst of the full limit and refills continuously admits up to twice
the limit in the first minute of a flood (the burst, then the refill), and
``L`` plus the refill in any minute after an idle one: "600 requests per
minute" would not mean what it says. A sliding window admits at most the limit
in any window. It is kept as ``buckets`` sub-windows (60 by default, one per
second of a minute): memory and Redis work per check are bounded by that number
whatever the traffic, unlike a log of every request; a settlement corrects the
sub-window its estimate went into; and the window is counted up to one
sub-window long rather than short, so the limit is never exceeded, only
approached from below (see ``policy.ratelimit.checks``).

**When Redis fails** the limiter does what ``fail_open`` says: admit
without counting, or refuse with a 503 (``RateLimiterUnavailable``); never a
500. Each failure increments ``backend_failures`` and calls ``on_failure``
(for a metric); the log gets one line per ``LOG_EVERY`` seconds at most. After a
failure the backend is not tried again for ``retry_backend_after`` seconds, so
a Redis that hangs does not add its timeout to every request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from inferflux.policy.bounded import remember
from inferflux.policy.errors import ValidationFailed
from inferflux.policy.ratelimit.background import every, stop
from inferflux.policy.ratelimit.checks import Backend, BackendUnavailable, Check, Dimension, Level
from inferflux.policy.ratelimit.counters import Counters
from inferflux.policy.ratelimit.errors import RateLimiterUnavailable
from inferflux.policy.ratelimit.headers import RateLimitInfo
from inferflux.policy.ratelimit.outcomes import BudgetCrossing, Denial, denial_of, info_of
from inferflux.policy.ratelimit.resolver import EffectiveLimits, Scheduling
from inferflux.policy.rbac import Principal
from inferflux.policy.usage.cost import Price, cost_micros

log = logging.getLogger("inferflux.policy.ratelimit")

LOG_EVERY = 10.0  # seconds between two log lines about a failing backend
BUDGET_THRESHOLDS = (50, 80, 100)  # percent of a budget whose crossing is reported (on_budget)
MAX_ALERTS_KEPT = 10_000


class LimitSource(Protocol):
    """Where the limiter learns a principal's limits (``PolicyResolver``, or ``FixedLimits``)."""

    async def limits_for(self, principal: Principal) -> EffectiveLimits: ...

    def observe(self, version: int) -> None:
        """The store's ``policy_version``, read just now by another poller (``PolicyResolver.observe``)."""


@dataclass(frozen=True, slots=True)
class FixedLimits:
    """The same limits for everyone (tests, benchmarks, a deployment without a store)."""

    limits: EffectiveLimits

    async def limits_for(self, principal: Principal) -> EffectiveLimits:
        return self.limits

    def observe(self, version: int) -> None:
        """Nothing to reload: these limits are not read from the store."""


@dataclass(eq=False, slots=True)
class Handle:
    """What ``settle`` needs to know about an admitted request. Settle it exactly once (more is harmless)."""

    lease_id: str
    checks: tuple[Check, ...]
    estimated_tokens: int
    reserved_at: float  # the limiter's clock
    counted: bool  # False: admitted without counting (no limits, or fail-open)
    started: float = field(default_factory=time.monotonic)
    price: Price | None = None  # the model's, for the spend counters
    estimated_cost: int = 0  # micro-dollars charged to the spend counters at admission
    tenant_id: str = ""
    subject: str | None = None  # the caller's key id or subject
    settled: bool = False


@dataclass(frozen=True, slots=True)
class Admission:
    """The request may run; ``headers`` are the x-ratelimit-* values to send with its response."""

    handle: Handle
    info: RateLimitInfo

    @property
    def headers(self) -> dict[str, str]:
        return self.info.headers()


class _LeaseIds:
    """Unique lease ids without a system call each: a random prefix per process, and a counter.

    Lease ids name concurrency slots shared by every replica (in Redis), so
    they must not collide across processes; they are never shown to clients.
    A forked child draws its own prefix.
    """

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self._prefix, self._counter = secrets.token_hex(8), itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):x}"


_lease_ids = _LeaseIds()


def _tokens(value: object, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValidationFailed(f"{param} must be a non-negative integer", param=param)
    return value


class RateLimiter:
    """Rate limits, concurrency and quotas for each request, over a ``Backend``.

    ``window_seconds`` is what "per minute" means (60; tests scale it down);
    ``lease_seconds`` is how long a concurrency slot survives a replica that
    died holding it (leases of running requests are renewed every third of it).
    """

    def __init__(
        self,
        backend: Backend,
        limits: LimitSource,
        *,
        window_seconds: float = 60.0,
        buckets: int = 60,
        completion_estimate: int = 256,
        lease_seconds: float = 30.0,
        max_request_seconds: float = 3600.0,
        fail_open: bool = False,
        retry_backend_after: float = 1.0,
        on_failure: Callable[[str], None] | None = None,
        on_budget: Callable[[BudgetCrossing], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not window_seconds > 0 or buckets < 1 or not lease_seconds > 0:
            raise ValueError("window_seconds and lease_seconds must be positive, buckets at least 1")
        self.backend = backend
        self.limits = limits
        self.window_seconds = float(window_seconds)
        self.buckets = buckets
        self.completion_estimate = _tokens(completion_estimate, "completion_estimate")
        self.lease_seconds = lease_seconds
        self.max_request_seconds = max_request_seconds
        self.fail_open = fail_open
        self.retry_backend_after = retry_backend_after
        self.on_failure = on_failure
        self.on_budget = on_budget
        self._alerted: dict[tuple[str, int], bool] = {}  # (counter, threshold) reported by this process
        self.backend_failures = 0  # every backend call that failed or was skipped as down
        self._clock = clock
        self._down_until = float("-inf")  # monotonic
        self._logged_at = float("-inf")
        self._unlogged = 0
        self._running: dict[str, Handle] = {}  # holders of concurrency slots, for renewal
        self._counters = Counters(self.window_seconds, buckets)
        self._renewer: asyncio.Task[None] | None = None

    # -- lifecycle

    async def start(self) -> None:
        """Start the backend's background work and the renewal of running requests' leases."""
        await self.backend.start()
        if self._renewer is None:
            work = every(self.lease_seconds / 3, self.renew_leases, "renewing rate-limit leases")
            self._renewer = asyncio.create_task(work, name="ratelimit-leases")

    async def close(self) -> None:
        """Stop renewing and close the backend (the memory backend writes its quota usage)."""
        await stop(self._renewer)
        self._renewer = None
        await self.backend.close()

    async def unavailable(self) -> str | None:
        """Why requests would be refused for want of the backend (fail-closed and it does not answer), or None."""
        ping = getattr(self.backend, "ping", None)
        if self.fail_open or ping is None:
            return None
        try:
            await ping()
        except BackendUnavailable as exc:
            return str(exc)
        return None

    # -- the request path

    async def scheduling_for(self, principal: Principal) -> Scheduling:
        """The priority bounds and weight the caller's traffic policy gives it (the same source as its limits)."""
        return (await self.limits.limits_for(principal)).scheduling

    async def check_and_reserve(
        self, principal: Principal, *, prompt_tokens: int, max_tokens: int | None = None, price: Price | None = None
    ) -> Admission | Denial:
        """Admit (and charge) the request, or say which limit refuses it.

        Raises ``ValidationFailed`` for negative token counts, and
        ``RateLimiterUnavailable`` (503) when the backend is down and the
        limiter fails closed.
        """
        prompt_tokens = _tokens(prompt_tokens, "prompt_tokens")
        completion = self.completion_estimate if max_tokens is None else _tokens(max_tokens, "max_tokens")
        estimated = prompt_tokens + completion
        cost = cost_micros(prompt_tokens, completion, price)
        limits = await self.limits.limits_for(principal)
        now = self._clock()
        lease_id = _lease_ids.next()
        checks = tuple(self._counters.checks(principal, limits, estimated, cost, now))
        if not checks:
            return Admission(Handle(lease_id, (), estimated, now, counted=False), RateLimitInfo())
        try:
            self._ensure_up()
            admitted, results = await self.backend.reserve(checks, lease_id, now + self.lease_seconds, now)
        except BackendUnavailable as exc:
            self._failed("check", exc)
            if not self.fail_open:
                raise RateLimiterUnavailable("Rate limiting is unavailable; retry shortly") from None
            return Admission(Handle(lease_id, (), estimated, now, counted=False), RateLimitInfo())
        info = info_of(checks, results, now if admitted else None)
        if not admitted:
            return denial_of(checks, results, info)
        handle = Handle(lease_id, checks, estimated, now, counted=True, price=price, estimated_cost=cost,
                        tenant_id=principal.tenant_id, subject=principal.key_id or principal.subject)
        if any(c.dimension is Dimension.CONCURRENCY for c in checks):
            self._running[lease_id] = handle
        return Admission(handle, info)

    async def settle(self, handle: Handle, prompt_tokens: int, completion_tokens: int) -> None:
        """Replace the estimate with the real token counts and free the concurrency slot.

        Never raises for a backend failure (the slot then frees when its
        lease expires). Bad counts raise ``ValidationFailed``, after the slot
        is freed all the same.
        """
        if handle.settled:
            return
        handle.settled = True
        self._running.pop(handle.lease_id, None)
        error: ValidationFailed | None = None
        try:
            prompt, completion = _tokens(prompt_tokens, "prompt_tokens"), _tokens(completion_tokens, "completion_tokens")
            delta = prompt + completion - handle.estimated_tokens
            spend = cost_micros(prompt, completion, handle.price) - handle.estimated_cost
        except ValidationFailed as exc:
            error, delta, spend = exc, 0, 0
        if handle.counted:
            try:
                self._ensure_up()
                budgets = await self.backend.settle(
                    handle.checks, handle.lease_id, handle.reserved_at, delta, self._clock(), spend_delta=spend
                )
                self._report_budgets(handle, budgets)
            except BackendUnavailable as exc:
                self._failed("settle", exc)
        if error is not None:
            raise error

    async def renew_leases(self) -> None:
        """Extend the concurrency leases of running requests (the background task calls this)."""
        now = self._clock()
        oldest = time.monotonic() - self.max_request_seconds
        for lease_id, handle in list(self._running.items()):
            if handle.started < oldest:  # never settled: a bug upstream; let its lease lapse
                del self._running[lease_id]
                log.warning(
                    "a rate-limited request ran past %.0f s without settling; its slot lapses", self.max_request_seconds
                )
        leases = [(h.lease_id, h.checks) for h in self._running.values()]
        if not leases:
            return
        try:
            self._ensure_up()
            await self.backend.renew(leases, now + self.lease_seconds, now)
        except BackendUnavailable as exc:
            self._failed("renew", exc)

    # -- internals

    def _report_budgets(self, handle: Handle, values: list[int]) -> None:
        """Call ``on_budget`` for each threshold a budget counter has reached, once per counter and threshold."""
        budgets = [c for c in handle.checks if c.dimension.kind == "b"]
        if self.on_budget is None:
            return
        for check, used in zip(budgets, values, strict=False):
            for threshold in BUDGET_THRESHOLDS:
                if used * 100 < threshold * check.limit or (check.key, threshold) in self._alerted:
                    continue
                remember(self._alerted, (check.key, threshold), True, MAX_ALERTS_KEPT)
                subject = handle.subject if check.level is Level.KEY else None
                crossing = BudgetCrossing(handle.tenant_id, subject, check.dimension, check.level, check.key,
                                          check.limit, used, threshold)  # fmt: skip
                try:
                    self.on_budget(crossing)
                except Exception:  # a reporting hook must not break settlement
                    log.exception("rate limiter on_budget hook failed")

    def _ensure_up(self) -> None:
        if time.monotonic() < self._down_until:
            raise BackendUnavailable("marked down after a recent failure")

    def _failed(self, operation: str, exc: BackendUnavailable) -> None:
        self.backend_failures += 1
        self._unlogged += 1
        now = time.monotonic()
        if now >= self._down_until:
            self._down_until = now + self.retry_backend_after
        if self.on_failure is not None:
            try:
                self.on_failure(operation)
            except Exception:  # a metrics hook must not break the request path
                log.exception("rate limiter on_failure hook failed")
        if now - self._logged_at >= LOG_EVERY:
            log.error(
                "rate limiter backend unavailable (%d failure(s) since the last report, the last during %s): %s; "
                "requests are %s",
                self._unlogged,
                operation,
                exc,
                "admitted without limits (fail-open)" if self.fail_open else "refused with 503 (fail-closed)",
            )
            self._logged_at = now
            self._unlogged = 0
