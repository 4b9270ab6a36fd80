"""The limiter's own contract: input checks, settle's guarantees, lease renewal in the background,
the failure hook, and limits read from the policy store taking effect without a restart."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import pytest

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.ratelimit import (
    Admission,
    Denial,
    EffectiveLimits,
    FixedLimits,
    Limits,
    MemoryBackend,
    PolicyResolver,
    RateLimiter,
)
from inferflux.policy.ratelimit.checks import Dimension
from inferflux.policy.ratelimit.counters import period_of
from inferflux.policy.ratelimit.limiter import _lease_ids
from inferflux.policy.store import PolicyStore

from ratelimit_helpers import FakeClock, LimiterFactory, PrincipalFactory

ONE_AT_A_TIME = Limits(concurrent_requests=1)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "param"),
    [
        (-1, 0, "prompt_tokens"),
        (1.5, 0, "prompt_tokens"),
        (True, 0, "prompt_tokens"),
        (1, -3, "max_tokens"),
        (1, "9", "max_tokens"),
    ],
)
async def test_token_counts_are_checked(
    make_limiter: LimiterFactory, make_principal: PrincipalFactory, prompt: object, max_tokens: object, param: str
) -> None:
    limiter = make_limiter(tenant=ONE_AT_A_TIME)
    with pytest.raises(ValidationFailed) as info:
        await limiter.check_and_reserve(
            make_principal(), prompt_tokens=prompt, max_tokens=max_tokens  # type: ignore[arg-type]
        )
    assert info.value.param == param
    assert isinstance(await limiter.check_and_reserve(make_principal(), prompt_tokens=1), Admission)  # nothing was held


async def test_bad_settle_counts_still_free_the_slot(
    make_limiter: LimiterFactory, make_principal: PrincipalFactory
) -> None:
    limiter = make_limiter(tenant=ONE_AT_A_TIME)
    admission = await limiter.check_and_reserve(make_principal(), prompt_tokens=1)
    assert isinstance(admission, Admission)
    with pytest.raises(ValidationFailed, match="completion_tokens"):
        await limiter.settle(admission.handle, prompt_tokens=1, completion_tokens=-1)
    assert isinstance(await limiter.check_and_reserve(make_principal(), prompt_tokens=1), Admission)


class RenewalsSeen(MemoryBackend):
    """The memory backend, telling when the limiter's background task renewed leases."""

    def __init__(self) -> None:
        super().__init__()
        self.renewed = asyncio.Event()

    async def renew(self, *args: Any) -> None:
        await super().renew(*args)
        self.renewed.set()


async def test_running_requests_keep_their_slots(clock: FakeClock, make_principal: PrincipalFactory) -> None:
    # The background task renews every lease_seconds / 3 of real time; leases are
    # judged on the fake clock, moved on only after each renewal and by less than a
    # lease, so the slot outlives several leases only if the task kept renewing it.
    backend = RenewalsSeen()
    limiter = RateLimiter(backend, FixedLimits(EffectiveLimits(ONE_AT_A_TIME)), lease_seconds=0.3, clock=clock)
    await limiter.start()
    try:
        admission = await limiter.check_and_reserve(make_principal(), prompt_tokens=1)
        assert isinstance(admission, Admission)
        for _ in range(4):  # 0.8 s of the clock: more than two leases
            backend.renewed.clear()
            await asyncio.wait_for(backend.renewed.wait(), timeout=30)
            clock.advance(0.2)
        assert isinstance(await limiter.check_and_reserve(make_principal(), prompt_tokens=1), Denial)
        await limiter.settle(admission.handle, prompt_tokens=1, completion_tokens=1)
        assert isinstance(await limiter.check_and_reserve(make_principal(), prompt_tokens=1), Admission)
    finally:
        await limiter.close()


async def test_a_never_settled_request_stops_being_renewed(
    make_limiter: LimiterFactory, clock: FakeClock, make_principal: PrincipalFactory, caplog: pytest.LogCaptureFixture
) -> None:
    limiter = make_limiter(tenant=ONE_AT_A_TIME, lease_seconds=5, max_request_seconds=0)
    assert isinstance(await limiter.check_and_reserve(make_principal(), prompt_tokens=1), Admission)
    with caplog.at_level(logging.WARNING, logger="inferflux.policy.ratelimit"):
        await limiter.renew_leases()
    assert "without settling" in caplog.text
    clock.advance(6)
    assert isinstance(await limiter.check_and_reserve(make_principal(), prompt_tokens=1), Admission)


class Broken:
    """A backend that is always down (what RedisBackend raises when Redis is)."""

    async def reserve(self, *args: object) -> tuple[bool, list[object]]:
        from inferflux.policy.ratelimit import BackendUnavailable

        raise BackendUnavailable("down")


async def test_a_failing_metrics_hook_does_not_break_requests(make_principal: PrincipalFactory) -> None:
    def hook(operation: str) -> None:
        raise RuntimeError("metrics are down too")

    broken: Any = Broken()
    limiter = RateLimiter(broken, FixedLimits(EffectiveLimits(ONE_AT_A_TIME)), fail_open=True, on_failure=hook)
    assert isinstance(await limiter.check_and_reserve(make_principal(), prompt_tokens=1), Admission)
    assert limiter.backend_failures == 1


async def test_limits_from_the_store_apply_without_restart(
    sqlite_store: PolicyStore, clock: FakeClock, make_principal: PrincipalFactory
) -> None:
    tenant = sqlite_store.create_tenant("acme")
    policy = sqlite_store.create_policy(tenant.id, "rate_limit", "rpm", {"requests_per_minute": 1})
    resolver = PolicyResolver(sqlite_store, poll_interval=0)
    limiter = RateLimiter(MemoryBackend(), resolver, clock=clock)
    me = make_principal(tenant.id, "key_1")
    assert isinstance(await limiter.check_and_reserve(me, prompt_tokens=1), Admission)
    denial = await limiter.check_and_reserve(me, prompt_tokens=1)
    assert isinstance(denial, Denial) and denial.limit == 1
    sqlite_store.update_policy(tenant.id, policy.id, spec={"requests_per_minute": 2})
    assert isinstance(await limiter.check_and_reserve(me, prompt_tokens=1), Admission)
    sqlite_store.update_policy(tenant.id, policy.id, enabled=False)
    for _ in range(5):
        assert isinstance(await limiter.check_and_reserve(me, prompt_tokens=1), Admission)


@pytest.mark.parametrize(
    ("now", "day", "month"),
    [
        (1_767_225_599.5, ("2025-12-31", 1_767_225_600.0), ("2025-12", 1_767_225_600.0)),  # the last instant of a year
        (1_767_225_600.0, ("2026-01-01", 1_767_312_000.0), ("2026-01", 1_769_904_000.0)),
        (1_709_164_800.0, ("2024-02-29", 1_709_251_200.0), ("2024-02", 1_709_251_200.0)),  # a leap day
    ],
)
def test_quota_periods_are_utc_calendar_days_and_months(
    now: float, day: tuple[str, float], month: tuple[str, float]
) -> None:
    assert period_of(Dimension.DAY, now) == day
    assert period_of(Dimension.MONTH, now) == month


def test_lease_ids_are_unique_and_a_forked_child_draws_its_own() -> None:
    # Lease ids name concurrency slots every replica shares in Redis: a forked
    # worker continuing its parent's sequence would collide with it.
    ids = {_lease_ids.next() for _ in range(10_000)}
    assert len(ids) == 10_000
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next ids and leave at once
        os.write(write, " ".join(_lease_ids.next() for _ in range(100)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = set(pipe.read().split())
    os.waitpid(pid, 0)
    parent = {_lease_ids.next() for _ in range(100)}
    assert len(child) == 100 and not child & (ids | parent)
