"""Every kind of limit, on both backends (the same tests, the same answers): requests, tokens,
concurrency, quotas per day and month, settling the real counts, leases, headers and 429s."""

from __future__ import annotations

from datetime import UTC, datetime


from inferflux.policy.ratelimit import (
    Admission,
    Denial,
    Dimension,
    Level,
    Limits,
    QuotaExceeded,
    RateLimited,
    RateLimiter,
    TokensRateLimited,
)
from inferflux.policy.rbac import Principal

from ratelimit_helpers import FakeClock, LimiterFactory, PrincipalFactory


async def admit(limiter: RateLimiter, principal: Principal, prompt: int = 10, max_tokens: int | None = 0) -> Admission:
    result = await limiter.check_and_reserve(principal, prompt_tokens=prompt, max_tokens=max_tokens)
    assert isinstance(result, Admission), result
    return result


async def deny(limiter: RateLimiter, principal: Principal, prompt: int = 10, max_tokens: int | None = 0) -> Denial:
    result = await limiter.check_and_reserve(principal, prompt_tokens=prompt, max_tokens=max_tokens)
    assert isinstance(result, Denial), result
    return result


async def test_requests_per_minute_slide(
    make_limiter: LimiterFactory, clock: FakeClock, make_principal: PrincipalFactory
) -> None:
    limiter = make_limiter(tenant=Limits(requests_per_minute=3))
    me = make_principal()
    await admit(limiter, me)
    await admit(limiter, me)
    clock.advance(30)
    await admit(limiter, me)
    denial = await deny(limiter, me)
    assert (denial.dimension, denial.level, denial.limit, denial.used) == (Dimension.REQUESTS, Level.TENANT, 3, 3)
    # The two from t=0 leave when their one-second bucket leaves the window: at 61 s.
    assert denial.retry_after == 31.0
    clock.advance(30.5)
    await deny(limiter, me)
    clock.advance(0.5)
    await admit(limiter, me)
    await admit(limiter, me)  # both of t=0 are gone, the one of t=30 still counts
    await deny(limiter, me)


async def test_no_minute_admits_more_than_the_limit(
    make_limiter: LimiterFactory, clock: FakeClock, make_principal: PrincipalFactory
) -> None:
    limiter = make_limiter(tenant=Limits(requests_per_minute=20))
    me = make_principal()
    admitted: list[float] = []
    for _ in range(600):  # 3 minutes at 200 requests per minute: ten times the limit
        if isinstance(await limiter.check_and_reserve(me, prompt_tokens=1, max_tokens=0), Admission):
            admitted.append(clock.now)
        clock.advance(0.3)
    for start in admitted:
        assert sum(start <= t < start + 60 for t in admitted) <= 20
    assert len(admitted) >= 3 * 20 * 60 / 61 - 1  # and the limit is used: about 20 per 61 s


async def test_key_and_tenant_counters(make_limiter: LimiterFactory, make_principal: PrincipalFactory) -> None:
    limiter = make_limiter(tenant=Limits(requests_per_minute=3), key=Limits(requests_per_minute=2))
    one, two = make_principal(key="key_1"), make_principal(key="key_2")
    await admit(limiter, one)
    await admit(limiter, one)
    assert (await deny(limiter, one)).level is Level.KEY
    await admit(limiter, two)
    denial = await deny(limiter, two)  # key_2 has one left, but the tenant has none
    assert (denial.level, denial.limit) == (Level.TENANT, 3)
    oidc = make_principal(tenant="ten_b", key=None, subject="oidc:corp:alice")  # another tenant's counters
    await admit(limiter, oidc)
    await admit(limiter, oidc)
    assert (await deny(limiter, oidc)).level is Level.KEY  # an OIDC user has counters of its own
    await admit(limiter, make_principal(tenant="ten_b", key="key_1"))


async def test_tokens_per_minute_use_the_real_counts(
    make_limiter: LimiterFactory, make_principal: PrincipalFactory
) -> None:
    limiter = make_limiter(key=Limits(tokens_per_minute=1000))
    me = make_principal()
    first = await admit(limiter, me, prompt=100, max_tokens=400)  # estimate 500
    assert first.headers["x-ratelimit-remaining-tokens"] == "500"
    second = await admit(limiter, me, prompt=100, max_tokens=400)
    assert second.headers["x-ratelimit-remaining-tokens"] == "0"
    denial = await deny(limiter, me, prompt=100, max_tokens=400)
    assert (denial.dimension, denial.used, denial.requested) == (Dimension.TOKENS, 1000, 500)
    assert isinstance(denial.error(), TokensRateLimited)

    await limiter.settle(first.handle, prompt_tokens=100, completion_tokens=50)  # 350 fewer than estimated
    assert (await deny(limiter, me, prompt=100, max_tokens=400)).used == 650
    await limiter.settle(second.handle, prompt_tokens=100, completion_tokens=50)
    third = await admit(limiter, me, prompt=100, max_tokens=400)
    assert third.headers["x-ratelimit-remaining-tokens"] == "200"  # 150 + 150 + 500 used

    # Settling more than the estimate (a stream that ran long) raises the usage.
    await limiter.settle(third.handle, prompt_tokens=100, completion_tokens=900)
    assert (await deny(limiter, me, prompt=1, max_tokens=0)).used == 1300
    await limiter.settle(third.handle, prompt_tokens=100, completion_tokens=10_000)  # a second settle changes nothing
    assert (await deny(limiter, me, prompt=1, max_tokens=0)).used == 1300


async def test_settling_after_the_window_moved_on(
    make_limiter: LimiterFactory, clock: FakeClock, make_principal: PrincipalFactory
) -> None:
    limiter = make_limiter(key=Limits(tokens_per_minute=1000))
    me = make_principal()
    long_stream = await admit(limiter, me, prompt=100, max_tokens=100)
    clock.advance(120)  # its estimate has left the window by the time it ends ...
    await limiter.settle(long_stream.handle, prompt_tokens=100, completion_tokens=700)
    # ... so only what it used beyond the estimate is charged, now
    assert (await deny(limiter, me, prompt=600, max_tokens=0)).used == 600
    await admit(limiter, me, prompt=400, max_tokens=0)


async def test_a_request_larger_than_the_limit_is_told_so(
    make_limiter: LimiterFactory, make_principal: PrincipalFactory
) -> None:
    limiter = make_limiter(tenant=Limits(tokens_per_minute=1000), completion_estimate=300)
    denial = await deny(limiter, make_principal(), prompt=800, max_tokens=None)  # 800 + the configured 300
    assert denial.requested == 1100 and denial.retry_after == 60.0
    assert "Request too large" in denial.error().message and "max_tokens" in denial.error().message
    await admit(limiter, make_principal(), prompt=600, max_tokens=None)


async def test_concurrency_slots_are_released_by_settle(
    make_limiter: LimiterFactory, make_principal: PrincipalFactory
) -> None:
    limiter = make_limiter(tenant=Limits(concurrent_requests=2))
    me = make_principal()
    first = await admit(limiter, me)
    await admit(limiter, me)
    denial = await deny(limiter, me)
    assert (denial.dimension, denial.limit, denial.retry_after) == (Dimension.CONCURRENCY, 2, 1.0)
    error = denial.error()
    assert type(error) is RateLimited and "concurrent" in error.message
    await limiter.settle(first.handle, prompt_tokens=10, completion_tokens=3)
    await admit(limiter, me)
    await deny(limiter, me)


async def test_concurrency_leases_expire_unless_renewed(
    make_limiter: LimiterFactory, clock: FakeClock, make_principal: PrincipalFactory
) -> None:
    # A replica that died holding slots: its limiter never settles or renews again.
    dead = make_limiter(tenant=Limits(concurrent_requests=1), lease_seconds=5)
    alive = make_limiter(tenant=Limits(concurrent_requests=1), lease_seconds=5)
    me = make_principal()
    await admit(dead, me)
    await deny(alive, me)
    clock.advance(5.5)
    running = await admit(alive, me)  # the dead one's lease lapsed

    clock.advance(3)
    await alive.renew_leases()  # a running request's lease is renewed to now + 5 ...
    clock.advance(3)
    await deny(alive, me)  # ... so it still holds its slot past its first lease
    clock.advance(2.5)
    await admit(alive, me)  # and loses it once it stops being renewed
    await alive.settle(running.handle, prompt_tokens=1, completion_tokens=1)  # settling a lapsed lease is harmless


async def test_daily_quota_rolls_over_at_utc_midnight(
    make_limiter: LimiterFactory, clock: FakeClock, make_principal: PrincipalFactory
) -> None:
    limiter = make_limiter(tenant=Limits(tokens_per_day=1000))
    me = make_principal()
    reserved = await admit(limiter, me, prompt=100, max_tokens=500)
    await limiter.settle(reserved.handle, prompt_tokens=100, completion_tokens=0)
    await admit(limiter, me, prompt=900, max_tokens=0)  # 100 real + 900
    denial = await deny(limiter, me, prompt=1, max_tokens=0)
    assert (denial.dimension, denial.used, denial.retry_after) == (Dimension.DAY, 1000, 3600.0)
    error = denial.error()
    assert isinstance(error, QuotaExceeded)
    assert (error.status_code, error.error_type, error.code) == (429, "insufficient_quota", "insufficient_quota")
    assert error.headers["retry-after"] == "3600"
    clock.advance(3600)
    assert datetime.fromtimestamp(clock.now, UTC).day == 1
    await admit(limiter, me, prompt=1000, max_tokens=0)


async def test_monthly_quota_and_a_settlement_across_the_rollover(
    make_limiter: LimiterFactory, clock: FakeClock, make_principal: PrincipalFactory
) -> None:
    limiter = make_limiter(key=Limits(tokens_per_month=500))
    me = make_principal()
    clock.advance(3599)  # 23:59:59 on the last day of December
    late = await admit(limiter, me, prompt=100, max_tokens=400)
    await deny(limiter, me, prompt=1, max_tokens=0)
    clock.advance(2)  # January
    fresh = await admit(limiter, me, prompt=500, max_tokens=0)
    # The December request ends in January: its correction goes to December, January is untouched.
    await limiter.settle(late.handle, prompt_tokens=100, completion_tokens=0)
    await deny(limiter, me, prompt=1, max_tokens=0)
    await limiter.settle(fresh.handle, prompt_tokens=10, completion_tokens=0)
    await admit(limiter, me, prompt=490, max_tokens=0)
    clock.advance(-10)  # and December has 400 back
    await admit(limiter, me, prompt=400, max_tokens=0)
    await deny(limiter, me, prompt=1, max_tokens=0)


async def test_a_refused_request_charges_nothing(
    make_limiter: LimiterFactory, make_principal: PrincipalFactory
) -> None:
    limiter = make_limiter(tenant=Limits(requests_per_minute=5, concurrent_requests=1, tokens_per_day=100))
    me = make_principal()
    held = await admit(limiter, me, prompt=10)
    for _ in range(3):
        assert (await deny(limiter, me)).dimension is Dimension.CONCURRENCY
    await limiter.settle(held.handle, prompt_tokens=10, completion_tokens=0)
    await admit(limiter, me, prompt=90)  # the three refusals took neither requests nor tokens


async def test_headers(make_limiter: LimiterFactory, clock: FakeClock, make_principal: PrincipalFactory) -> None:
    limiter = make_limiter(
        tenant=Limits(requests_per_minute=10, tokens_per_minute=1000), key=Limits(requests_per_minute=2)
    )
    me = make_principal()
    clock.advance(0.25)
    first = await admit(limiter, me, prompt=60, max_tokens=40)
    # the key's counter has less left than the tenant's: it is the one shown
    assert first.headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "1m0.75s",  # until the request's bucket leaves the window
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "900",
        "x-ratelimit-reset-tokens": "1m0.75s",
    }
    clock.advance(10)
    await admit(limiter, me, prompt=100, max_tokens=0)
    denial = await deny(limiter, me, prompt=100, max_tokens=0)
    assert denial.retry_after == 50.75
    assert denial.headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0.75s",  # the newer of the two is gone at 71 s
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "800",
        "x-ratelimit-reset-tokens": "1m0.75s",
        "retry-after": "51",
    }
    error = denial.error()
    assert (error.status_code, error.error_type, error.code) == (429, "requests", "rate_limit_exceeded")
    assert error.headers == denial.headers
    assert "Rate limit reached" in error.message and "50.75s" in error.message


async def test_no_limits_means_no_counting(make_limiter: LimiterFactory, make_principal: PrincipalFactory) -> None:
    limiter = make_limiter()
    admission = await admit(limiter, make_principal(), prompt=10**9)
    assert admission.headers == {} and not admission.handle.counted
    await limiter.settle(admission.handle, prompt_tokens=1, completion_tokens=1)
    assert limiter.backend_failures == 0
