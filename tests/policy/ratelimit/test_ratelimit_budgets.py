"""Budgets on both backends: a monthly spend or token budget admits until spent, then refuses (429
budget_exceeded); settlement charges the real cost; 50/80/100 % are reported once each; the spec."""

from __future__ import annotations

import pytest

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.ratelimit import Admission, BudgetCrossing, BudgetExceeded, Denial, Dimension, Level, Limits, parse_spec
from inferflux.policy.usage.cost import Price

from ratelimit_helpers import LimiterFactory, PrincipalFactory

PRICE = Price(prompt=1_000_000, completion=2_000_000)  # 1 and 2 micro-dollars a token


async def test_a_spend_budget_admits_until_spent_then_refuses(
    make_limiter: LimiterFactory, make_principal: PrincipalFactory
) -> None:
    crossings: list[BudgetCrossing] = []
    limiter = make_limiter(tenant=Limits(spend_micros_per_month=100), on_budget=crossings.append)
    me = make_principal()
    done = []
    for _ in range(4):  # each costs 10 + 2 * 5 = 20 micro-dollars when settled
        admitted = await limiter.check_and_reserve(me, prompt_tokens=10, max_tokens=50, price=PRICE)
        assert isinstance(admitted, Admission)
        await limiter.settle(admitted.handle, 10, 5)
        done.append(admitted)
    assert [(c.threshold, c.used) for c in crossings] == [(50, 60), (80, 80)]  # reported when settled
    # A request that would cross the budget still runs (the estimate of 110 does not matter): it is not spent.
    crossing = await limiter.check_and_reserve(me, prompt_tokens=10, max_tokens=50, price=PRICE)
    assert isinstance(crossing, Admission)
    await limiter.settle(crossing.handle, 10, 20)  # 50: 130 of 100
    assert [(c.threshold, c.used, c.dimension, c.level) for c in crossings[2:]] == [
        (100, 130, Dimension.SPEND, Level.TENANT)]
    refused = await limiter.check_and_reserve(me, prompt_tokens=1, max_tokens=0, price=PRICE)
    assert isinstance(refused, Denial) and refused.dimension is Dimension.SPEND
    error = refused.error()
    assert isinstance(error, BudgetExceeded)
    assert (error.status_code, error.error_type, error.code) == (429, "insufficient_quota", "budget_exceeded")
    assert "monthly spend budget of this tenant" in error.message and "$0.000100" in error.message
    # A model without a price costs nothing, but a spent budget refuses it all the same.
    assert isinstance(await limiter.check_and_reserve(me, prompt_tokens=1, max_tokens=0), Denial)


async def test_a_spend_budget_is_charged_the_estimated_cost_beside_rate_limits(
    make_limiter: LimiterFactory, make_principal: PrincipalFactory
) -> None:
    # Rate counters come before the budget in a request's checks; each charges one request or the
    # estimated tokens, and the budget must still be charged the estimated cost in micro-dollars.
    limiter = make_limiter(tenant=Limits(requests_per_minute=1000, tokens_per_minute=100_000,
                                         spend_micros_per_month=100))  # fmt: skip
    me = make_principal()
    first = await limiter.check_and_reserve(me, prompt_tokens=10, max_tokens=50, price=PRICE)  # 10 + 100
    assert isinstance(first, Admission) and first.handle.estimated_cost == 110
    # Still running, its estimate has spent the budget: a second request is refused until it settles.
    second = await limiter.check_and_reserve(me, prompt_tokens=1, max_tokens=0, price=PRICE)
    assert isinstance(second, Denial) and second.dimension is Dimension.SPEND
    await limiter.settle(first.handle, 10, 5)  # the real cost: 20 of 100
    admitted = 0
    while isinstance(later := await limiter.check_and_reserve(me, prompt_tokens=10, max_tokens=5, price=PRICE),
                     Admission):  # fmt: skip
        await limiter.settle(later.handle, 10, 5)
        admitted += 1
    assert admitted == 4 and later.dimension is Dimension.SPEND  # 20 + 4 * 20: spent


async def test_thresholds_are_reported_once_and_a_token_budget_for_a_key(
    make_limiter: LimiterFactory, make_principal: PrincipalFactory
) -> None:
    crossings: list[BudgetCrossing] = []
    limiter = make_limiter(key=Limits(budget_tokens_per_month=100), on_budget=crossings.append)
    me = make_principal()
    for used in (55, 30, 10):  # 55, 85, 95
        admitted = await limiter.check_and_reserve(me, prompt_tokens=used, max_tokens=0)
        assert isinstance(admitted, Admission)
        await limiter.settle(admitted.handle, used, 0)
    assert [(c.threshold, c.used, c.level, c.subject) for c in crossings] == [
        (50, 55, Level.KEY, "key_1"), (80, 85, Level.KEY, "key_1")]
    last = await limiter.check_and_reserve(me, prompt_tokens=1, max_tokens=10)  # estimated 11: runs
    assert isinstance(last, Admission)
    await limiter.settle(last.handle, 1, 4)  # 100
    assert [c.threshold for c in crossings] == [50, 80, 100]
    denial = await limiter.check_and_reserve(me, prompt_tokens=1, max_tokens=0)
    assert isinstance(denial, Denial) and "token budget of this API key" in denial.error().message
    other = make_principal(key="key_2")  # a key's budget is its own
    assert isinstance(await limiter.check_and_reserve(other, prompt_tokens=1, max_tokens=0), Admission)


def test_budget_spec() -> None:
    policy = parse_spec("budget", {"spend_usd": "2.50", "tokens": 1000, "per_key": {"spend_usd": 1}})
    assert dict(policy.limits) == {"spend_micros_per_month": 2_500_000, "budget_tokens_per_month": 1000}
    assert dict(policy.per_key) == {"spend_micros_per_month": 1_000_000}
    key = parse_spec("budget", {"scope": "key", "principal": "key_x", "spend_usd": None, "period": "month"})
    assert dict(key.limits) == {"spend_micros_per_month": None}
    for spec, param in (({"spend_usd": 2.5}, "spec.spend_usd"), ({"spend_usd": "0"}, "spec.spend_usd"),
                        ({"tokens": 0}, "spec.tokens"), ({"period": "day", "tokens": 1}, "spec.period"),
                        ({}, "spec"), ({"per_key": {"tokens_per_day": 1}}, "spec.per_key.tokens_per_day"),
                        ({"spend": "1"}, "spec.spend")):  # fmt: skip
        with pytest.raises(ValidationFailed) as caught:
            parse_spec("budget", spec)
        assert caught.value.param == param, spec
