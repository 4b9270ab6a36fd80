"""The in-process backend's own duties: quota usage survives a restart, written atomically;
stale counters are forgotten."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferflux.policy.ratelimit import Admission, EffectiveLimits, FixedLimits, Limits, MemoryBackend, RateLimiter
from inferflux.policy.ratelimit.checks import Check, Dimension, Level, bucket_of, window_check
from inferflux.policy.ratelimit.memory import STATE_FILE, _Window
from inferflux.policy.rbac import Principal

from ratelimit_helpers import FakeClock, PrincipalFactory

MONTHLY = EffectiveLimits(tenant=Limits(tokens_per_month=1000))


def limiter(backend: MemoryBackend, clock: FakeClock, limits: EffectiveLimits = MONTHLY) -> RateLimiter:
    return RateLimiter(backend, FixedLimits(limits), clock=clock)


async def spend(limiter: RateLimiter, who: Principal, tokens: int) -> bool:
    result = await limiter.check_and_reserve(who, prompt_tokens=tokens, max_tokens=0)
    if isinstance(result, Admission):
        await limiter.settle(result.handle, prompt_tokens=tokens, completion_tokens=0)
    return isinstance(result, Admission)


async def test_monthly_quota_survives_a_restart(
    tmp_path: Path, clock: FakeClock, make_principal: PrincipalFactory
) -> None:
    first = limiter(MemoryBackend(tmp_path, clock=clock), clock)
    me = make_principal()
    admission = await first.check_and_reserve(me, prompt_tokens=100, max_tokens=500)
    assert isinstance(admission, Admission)
    await first.settle(admission.handle, prompt_tokens=100, completion_tokens=600)  # 700 real
    await first.close()
    saved = json.loads((tmp_path / STATE_FILE).read_text())
    assert list(saved["quotas"].values())[0][0] == 700
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]  # no temporary file left behind

    second = limiter(MemoryBackend(tmp_path, clock=clock), clock)
    assert not await spend(second, me, 301)
    assert await spend(second, me, 300)
    await second.close()


async def test_usage_is_written_periodically(
    tmp_path: Path, clock: FakeClock, make_principal: PrincipalFactory
) -> None:
    backend = MemoryBackend(tmp_path, persist_interval=0.05, clock=clock)
    running = limiter(backend, clock)
    await running.start()
    try:
        assert await spend(running, make_principal(), 250)
        path = tmp_path / STATE_FILE
        for _ in range(100):  # up to 5 s; normally one interval
            if path.exists() and 250 in [v[0] for v in json.loads(path.read_text())["quotas"].values()]:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("quota usage was not written while running")
    finally:
        await running.close()


async def test_unreadable_usage_is_set_aside(
    tmp_path: Path, clock: FakeClock, make_principal: PrincipalFactory, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / STATE_FILE).write_text('{"version": 1, "quotas": {"k": [5')
    with caplog.at_level(logging.ERROR, logger="inferflux.policy.ratelimit"):
        backend = MemoryBackend(tmp_path, clock=clock)
    assert "unreadable" in caplog.text
    assert len(list(tmp_path.glob(f"{STATE_FILE}.corrupt-*"))) == 1
    assert await spend(limiter(backend, clock), make_principal(), 1000)


async def test_past_periods_are_not_loaded(tmp_path: Path, clock: FakeClock) -> None:
    (tmp_path / STATE_FILE).write_text(
        json.dumps({"version": 1, "quotas": {"old": [5, clock.now - 1], "current": [7, clock.now + 10]}})
    )
    backend = MemoryBackend(tmp_path, clock=clock)
    assert backend._quotas == {"current": [7, clock.now + 10]}


async def test_stale_counters_are_forgotten(clock: FakeClock, make_principal: PrincipalFactory) -> None:
    backend = MemoryBackend(clock=clock)
    limits = EffectiveLimits(
        Limits(requests_per_minute=5, tokens_per_minute=100, concurrent_requests=1, tokens_per_day=50)
    )
    running = limiter(backend, clock, limits)
    for tenant in ("ten_a", "ten_b", "ten_c"):
        result = await running.check_and_reserve(make_principal(tenant), prompt_tokens=1, max_tokens=0)
        assert isinstance(result, Admission)  # never settled: its lease must lapse too
    assert len(backend._windows) == 6 and len(backend._leases) == 3 and len(backend._quotas) == 3
    clock.advance(3 * 86400)
    later = await running.check_and_reserve(make_principal("ten_d"), prompt_tokens=1, max_tokens=0)
    assert isinstance(later, Admission)
    remaining = [*backend._windows, *backend._leases, *backend._quotas]
    assert remaining and all("{ten_d}" in key for key in remaining)


# -- the window's kept sum: what window_check says, without adding the buckets up

_WINDOW_STEPS = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 70), st.integers(-40, 40)),  # time step (buckets), bucket back, amount
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_WINDOW_STEPS, st.integers(1, 200), st.integers(0, 30))
def test_a_window_check_reads_the_kept_sum_as_window_check_adds_the_buckets(
    steps: list[tuple[int, int, int]], limit: int, cost: int
) -> None:
    # Charges and corrections (negative) land in buckets old and new, time moves on; at each step the
    # backend's admitted-request shortcut and the plain sum over the buckets must agree exactly.
    backend = MemoryBackend(None)
    check = Check(Dimension.REQUESTS, Level.TENANT, "k", limit, cost, 60.0, 60)
    now = 1_800_000_000.5
    for advance, back, amount in steps:
        now += advance
        window = backend._windows.setdefault("k", _Window())
        current = bucket_of(now, check.window, check.buckets)
        window.drop_before(current - check.buckets)
        window.add(current - min(back, check.buckets), amount)
        result, _ = backend._evaluate(check, "lease", now + 30, now)
        expected, _ = window_check(window.counts, check, now)
        assert result == expected
        assert window.used == sum(window.counts.values())
        positive = [i for i, c in window.counts.items() if c > 0]
        assert window.newest == (max(positive) if positive else None)
