"""Effective limits: key > tenant > global precedence, and edits taking effect without a restart."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import pytest

from inferflux.policy.ratelimit import DEFAULT_SCHEDULING, EffectiveLimits, Limits, PolicyResolver, Scheduling, effective_limits
from inferflux.policy.errors import PolicyUnusable

from ratelimit_helpers import PrincipalFactory
from inferflux.policy.store import PolicyRecord, PolicyStore

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def record(
    tenant_id: str | None, kind: str, spec: dict[str, Any], *, enabled: bool = True, name: str = "p"
) -> PolicyRecord:
    return PolicyRecord(
        id=f"pol_{name}",
        tenant_id=tenant_id,
        kind=kind,
        name=name,
        spec=spec,
        sensitive_spec=None,
        enabled=enabled,
        created_at=NOW,
        updated_at=NOW,
    )


RECORDS = [
    record(
        None,
        "rate_limit",
        {"requests_per_minute": 100, "tokens_per_minute": 10_000, "per_key": {"requests_per_minute": 10}},
    ),
    record(None, "quota", {"period": "month", "tokens": 1_000_000, "per_key": {"tokens": 50_000}}),
    record(
        "ten_a",
        "rate_limit",
        {"requests_per_minute": 50, "tokens_per_minute": None, "per_key": {"concurrent_requests": 4}},
    ),
    record("ten_a", "quota", {"period": "day", "tokens": 5_000}),
    record("ten_a", "rate_limit", {"scope": "key", "principal": "key_1", "requests_per_minute": 5}),
    record("ten_a", "rate_limit", {"scope": "key", "principal": "oidc:corp:alice", "requests_per_minute": 7}),
    record("ten_a", "quota", {"scope": "key", "principal": "key_1", "period": "month", "tokens": None}),
    record("ten_b", "rate_limit", {"scope": "key", "principal": "key_1", "requests_per_minute": 1}),  # another tenant's
    record("ten_a", "rate_limit", {"requests_per_minute": 1}, enabled=False, name="off"),
    record("ten_a", "guardrail", {"requests_per_minute": 1}, name="g"),  # not a limit at all
]


def test_key_over_tenant_over_global(make_principal: PrincipalFactory) -> None:
    limits = effective_limits(RECORDS, make_principal("ten_a", "key_1"))
    # the tenant's own counters: its policy, then the global one (null = unlimited, not inherited)
    assert limits.tenant == Limits(
        requests_per_minute=50, tokens_per_minute=None, tokens_per_day=5_000, tokens_per_month=1_000_000
    )
    # the key's: its own policy, then the tenant's per_key, then the global per_key
    assert limits.key == Limits(requests_per_minute=5, concurrent_requests=4, tokens_per_month=None)

    other_key = effective_limits(RECORDS, make_principal("ten_a", "key_2"))
    assert other_key.key == Limits(requests_per_minute=10, concurrent_requests=4, tokens_per_month=50_000)

    # an OIDC user is matched by its subject
    alice = effective_limits(RECORDS, make_principal("ten_a", None, subject="oidc:corp:alice"))
    assert alice.key.requests_per_minute == 7

    # a tenant without policies of its own gets the global defaults, and nothing of ten_a's or ten_b's
    assert effective_limits(RECORDS, make_principal("ten_c", "key_1")) == EffectiveLimits(
        Limits(requests_per_minute=100, tokens_per_minute=10_000, tokens_per_month=1_000_000),
        Limits(requests_per_minute=10, tokens_per_month=50_000),
    )


def test_scheduling_key_over_tenant_over_global_and_weight_per_tenant(make_principal: PrincipalFactory) -> None:
    records = [
        record(None, "rate_limit", {"max_priority": 50, "weight": 3}, name="g"),
        record("ten_a", "rate_limit", {"min_priority": 2, "weight": 2}, name="t1"),
        record("ten_a", "rate_limit", {"min_priority": 4, "weight": 5}, name="t2"),  # the strictest of a level wins
        record("ten_a", "rate_limit", {"scope": "key", "principal": "key_vip", "min_priority": -10}, name="k"),
        record("ten_a", "rate_limit", {"scope": "key", "principal": "key_low", "max_priority": 1}, name="x"),
    ]
    assert effective_limits(records, make_principal("ten_a", "key_1")).scheduling == Scheduling(4, 50, 2.0)
    assert effective_limits(records, make_principal("ten_a", "key_vip")).scheduling == Scheduling(-10, 50, 2.0)
    # crossed bounds from two levels: min_priority wins
    low = effective_limits(records, make_principal("ten_a", "key_low")).scheduling
    assert low == Scheduling(4, 4, 2.0) and low.default_priority == 4
    assert effective_limits(records, make_principal("ten_b", "key_1")).scheduling == Scheduling(0, 50, 3.0)
    # nothing set: only priorities 0..1000, weight 1
    assert effective_limits([], make_principal("ten_b", "key_1")).scheduling == DEFAULT_SCHEDULING
    assert DEFAULT_SCHEDULING.allows(0) and DEFAULT_SCHEDULING.allows(1000)
    assert not DEFAULT_SCHEDULING.allows(-1) and not DEFAULT_SCHEDULING.allows(1001)


def test_the_strictest_of_one_level_wins_and_nothing_means_unlimited(make_principal: PrincipalFactory) -> None:
    records = [
        record("ten_a", "rate_limit", {"requests_per_minute": 30}, name="a"),
        record("ten_a", "rate_limit", {"requests_per_minute": 20, "tokens_per_minute": None}, name="b"),
        record("ten_a", "rate_limit", {"tokens_per_minute": 900}, name="c"),
        record(None, "rate_limit", {"requests_per_minute": 1}, name="global"),
    ]
    limits = effective_limits(records, make_principal())
    assert limits.tenant.requests_per_minute == 20
    assert limits.tenant.tokens_per_minute == 900  # a number beats "unlimited" on the same level
    assert effective_limits([], make_principal()).unlimited


def test_an_invalid_stored_spec_fails_closed_naming_it(
    make_principal: PrincipalFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # Written around the admin API (or by an older version): running without the limit it was
    # meant to set would fail open, so the tenant's requests are refused until an admin fixes it.
    records = [
        record("ten_a", "rate_limit", {"requests_per_minut": 5}, name="typo"),
        record("ten_a", "quota", {"period": "day", "tokens": 9}),
    ]
    with caplog.at_level(logging.ERROR, logger="inferflux.policy.ratelimit"):
        with pytest.raises(PolicyUnusable) as refused:
            effective_limits(records, make_principal())
    assert refused.value.status_code == 503 and refused.value.code == "policy_unusable"
    assert "pol_typo" in refused.value.message and "requests_per_minut" in refused.value.message
    assert "pol_typo" in caplog.text
    other_tenant = effective_limits(records, make_principal("ten_b", "key_9"))
    assert other_tenant.unlimited  # another tenant's broken policy is not its problem


class Ticks:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_resolver_follows_the_store_without_restart(
    sqlite_store: PolicyStore, make_principal: PrincipalFactory
) -> None:
    tenant = sqlite_store.create_tenant("acme")
    key = make_principal(tenant.id, "key_x")
    policy = sqlite_store.create_policy(tenant.id, "rate_limit", "rpm", {"requests_per_minute": 10})
    sqlite_store.create_policy(None, "quota", "monthly", {"period": "month", "tokens": 1000})
    ticks = Ticks()
    resolver = PolicyResolver(sqlite_store, poll_interval=1.0, clock=ticks)

    assert (await resolver.limits_for(key)).tenant == Limits(requests_per_minute=10, tokens_per_month=1000)

    sqlite_store.update_policy(tenant.id, policy.id, spec={"requests_per_minute": 3})
    # cached until the next poll of policy_version ...
    assert (await resolver.limits_for(key)).tenant.requests_per_minute == 10
    ticks.now += 1.0
    # ... which sees the change
    assert (await resolver.limits_for(key)).tenant.requests_per_minute == 3

    sqlite_store.update_policy(tenant.id, policy.id, enabled=False)
    own = {"scope": "key", "principal": "key_x", "concurrent_requests": 1}
    sqlite_store.create_policy(tenant.id, "rate_limit", "key", own)
    ticks.now += 1.0
    limits = await resolver.limits_for(key)
    assert limits.tenant == Limits(tokens_per_month=1000) and limits.key == Limits(concurrent_requests=1)

    ticks.now += 1.0
    assert not await resolver.refresh()  # nothing changed since
    sqlite_store.delete_policy(tenant.id, policy.id)
    assert await resolver.refresh()


async def test_readings_of_another_poller_stand_for_its_own_polls(
    sqlite_store: PolicyStore, make_principal: PrincipalFactory
) -> None:
    # The gateway's authenticator reads policy_version every interval and hands it over (observe):
    # requests then never wait for a read of the version, and a change still drops the cache.
    tenant = sqlite_store.create_tenant("acme")
    key = make_principal(tenant.id, "key_x")
    policy = sqlite_store.create_policy(tenant.id, "rate_limit", "rpm", {"requests_per_minute": 10})
    ticks = Ticks()
    resolver = PolicyResolver(sqlite_store, poll_interval=1.0, clock=ticks)
    assert (await resolver.limits_for(key)).tenant.requests_per_minute == 10
    reads = 0
    read_version = sqlite_store.policy_version

    def counted() -> int:
        nonlocal reads
        reads += 1
        return read_version()

    sqlite_store.policy_version = counted  # type: ignore[method-assign]
    for step in range(1, 6):
        ticks.now = step * 1.0
        resolver.observe(read_version())
        ticks.now += 0.99
        assert (await resolver.limits_for(key)).tenant.requests_per_minute == 10
    assert reads == 0
    sqlite_store.update_policy(tenant.id, policy.id, spec={"requests_per_minute": 3})
    resolver.observe(read_version())
    assert (await resolver.limits_for(key)).tenant.requests_per_minute == 3 and reads == 0
    ticks.now += 2.0  # the readings stopped for two intervals: the resolver polls itself again
    await resolver.limits_for(key)
    assert reads == 1


async def test_resolver_reads_every_page(sqlite_store: PolicyStore, make_principal: PrincipalFactory) -> None:
    tenant = sqlite_store.create_tenant("big")
    for i in range(205):  # more than one page of list_policies
        sqlite_store.create_policy(tenant.id, "rate_limit", f"p{i}", {"requests_per_minute": 1000 - i})
    limits = await PolicyResolver(sqlite_store).limits_for(make_principal(tenant.id))
    assert limits.tenant.requests_per_minute == 1000 - 204
