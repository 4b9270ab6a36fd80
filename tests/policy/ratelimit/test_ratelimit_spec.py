"""The spec format of rate_limit and quota policies: what is accepted, and what is refused and why."""

from __future__ import annotations

from typing import Any

import pytest

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.ratelimit import LimitPolicy, parse_spec

VALID: list[tuple[str, dict[str, Any], bool, LimitPolicy]] = [
    ("rate_limit", {"requests_per_minute": 60}, False, LimitPolicy("tenant", None, {"requests_per_minute": 60}, {})),
    (
        "rate_limit",
        {"scope": "tenant", "tokens_per_minute": 1000, "concurrent_requests": 2, "per_key": {"requests_per_minute": 5}},
        True,
        LimitPolicy("tenant", None, {"tokens_per_minute": 1000, "concurrent_requests": 2}, {"requests_per_minute": 5}),
    ),
    # null: explicitly unlimited at this level (it overrides what a less specific policy sets)
    ("rate_limit", {"tokens_per_minute": None}, False, LimitPolicy("tenant", None, {"tokens_per_minute": None}, {})),
    (
        "rate_limit",
        {"per_key": {"concurrent_requests": 1}},
        True,
        LimitPolicy("tenant", None, {}, {"concurrent_requests": 1}),
    ),
    (
        "rate_limit",
        {"scope": "key", "principal": "key_123", "requests_per_minute": 1},
        False,
        LimitPolicy("key", "key_123", {"requests_per_minute": 1}, {}),
    ),
    ("quota", {"period": "day", "tokens": 10}, False, LimitPolicy("tenant", None, {"tokens_per_day": 10}, {})),
    (
        "quota",
        {"period": "month", "tokens": 10**9, "per_key": {"tokens": 10**6}},
        True,
        LimitPolicy("tenant", None, {"tokens_per_month": 10**9}, {"tokens_per_month": 10**6}),
    ),
    (
        "quota",
        {"scope": "key", "principal": "oidc:corp:alice", "period": "month", "tokens": None},
        False,
        LimitPolicy("key", "oidc:corp:alice", {"tokens_per_month": None}, {}),
    ),
]


@pytest.mark.parametrize(("kind", "spec", "is_global", "expected"), VALID)
def test_valid_specs(kind: str, spec: dict[str, Any], is_global: bool, expected: LimitPolicy) -> None:
    policy = parse_spec(kind, spec, is_global=is_global)
    assert (policy.scope, policy.principal) == (expected.scope, expected.principal)
    assert dict(policy.limits) == dict(expected.limits)
    assert dict(policy.per_key) == dict(expected.per_key)


INVALID: list[tuple[str, Any, bool, str]] = [
    ("guardrail", {"requests_per_minute": 1}, False, "kind"),
    ("rate_limit", ["requests_per_minute"], False, "spec"),
    ("rate_limit", {}, False, "spec"),
    ("rate_limit", {"scope": "tenant"}, False, "spec"),
    ("rate_limit", {"request_per_minute": 60}, False, "spec.request_per_minute"),  # a typo is not "no limit"
    ("rate_limit", {"requests_per_minute": 0}, False, "spec.requests_per_minute"),
    ("rate_limit", {"requests_per_minute": -5}, False, "spec.requests_per_minute"),
    ("rate_limit", {"requests_per_minute": 1.5}, False, "spec.requests_per_minute"),
    ("rate_limit", {"requests_per_minute": "60"}, False, "spec.requests_per_minute"),
    ("rate_limit", {"requests_per_minute": True}, False, "spec.requests_per_minute"),
    ("rate_limit", {"tokens_per_minute": 10**13}, False, "spec.tokens_per_minute"),
    ("rate_limit", {"scope": "org", "requests_per_minute": 1}, False, "spec.scope"),
    ("rate_limit", {"scope": "key", "requests_per_minute": 1}, False, "spec.principal"),
    ("rate_limit", {"scope": "key", "principal": "", "requests_per_minute": 1}, False, "spec.principal"),
    ("rate_limit", {"scope": "key", "principal": 7, "requests_per_minute": 1}, False, "spec.principal"),
    ("rate_limit", {"scope": "key", "principal": "k" * 301, "requests_per_minute": 1}, False, "spec.principal"),
    ("rate_limit", {"scope": "key", "principal": "key_1", "requests_per_minute": 1}, True, "spec.scope"),
    ("rate_limit", {"principal": "key_1", "requests_per_minute": 1}, False, "spec.principal"),
    ("rate_limit", {"scope": "key", "principal": "key_1", "per_key": {"rpm": 1}}, False, "spec.per_key"),
    ("rate_limit", {"per_key": {}}, False, "spec.per_key"),
    ("rate_limit", {"per_key": 5}, False, "spec.per_key"),
    ("rate_limit", {"per_key": {"tokens": 5}}, False, "spec.per_key.tokens"),
    ("rate_limit", {"per_key": {"concurrent_requests": 0}}, False, "spec.per_key.concurrent_requests"),
    ("rate_limit", {"requests_per_minute": 1, "period": "day"}, False, "spec.period"),
    ("quota", {"tokens": 10}, False, "spec.period"),
    ("quota", {"period": "week", "tokens": 10}, False, "spec.period"),
    ("quota", {"period": "day"}, False, "spec"),
    ("quota", {"period": "day", "tokens": 0}, False, "spec.tokens"),
    ("quota", {"period": "day", "tokens": "lots"}, False, "spec.tokens"),
    ("quota", {"period": "day", "requests_per_minute": 5}, False, "spec.requests_per_minute"),
    ("quota", {"period": "day", "per_key": {"tokens": -1}}, False, "spec.per_key.tokens"),
    ("quota", {"period": "day", "per_key": {"period": "month"}}, False, "spec.per_key.period"),
    # scheduling: priority bounds and the tenant's weight
    ("rate_limit", {"min_priority": 1.5}, False, "spec.min_priority"),
    ("rate_limit", {"min_priority": True}, False, "spec.min_priority"),
    ("rate_limit", {"max_priority": 1001}, False, "spec.max_priority"),
    ("rate_limit", {"min_priority": -1001}, False, "spec.min_priority"),
    ("rate_limit", {"min_priority": 5, "max_priority": 4}, False, "spec.min_priority"),
    ("rate_limit", {"weight": 0}, False, "spec.weight"),
    ("rate_limit", {"weight": float("nan")}, False, "spec.weight"),
    ("rate_limit", {"weight": "2"}, False, "spec.weight"),
    ("rate_limit", {"weight": 1001}, False, "spec.weight"),
    ("rate_limit", {"scope": "key", "principal": "key_1", "weight": 2}, False, "spec.weight"),
    ("rate_limit", {"per_key": {"weight": 2}}, False, "spec.per_key.weight"),
    ("quota", {"period": "day", "tokens": 5, "max_priority": 3}, False, "spec.max_priority"),
]


def test_scheduling_fields_alone_make_a_policy() -> None:
    policy = parse_spec("rate_limit", {"min_priority": -5, "max_priority": 10, "weight": 2.5})
    assert dict(policy.scheduling) == {"min_priority": -5, "max_priority": 10, "weight": 2.5}
    assert not policy.limits and not policy.per_key
    key = parse_spec("rate_limit", {"scope": "key", "principal": "key_1", "min_priority": -1})
    assert dict(key.scheduling) == {"min_priority": -1}


@pytest.mark.parametrize(("kind", "spec", "is_global", "param"), INVALID)
def test_invalid_specs_name_the_field(kind: str, spec: Any, is_global: bool, param: str) -> None:
    with pytest.raises(ValidationFailed) as info:
        parse_spec(kind, spec, is_global=is_global)
    assert info.value.param == param
    assert info.value.status_code == 422 and info.value.code == "invalid_value"
    assert param.rsplit(".", 1)[-1] in info.value.message
