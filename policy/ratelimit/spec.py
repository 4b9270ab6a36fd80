"""The ``spec`` of ``rate_limit`` and ``quota`` policies: its format and its validation.

A ``rate_limit`` policy::

    {"scope": "tenant",                 # or "key"; "tenant" if absent
     "requests_per_minute": 600,        # each limit: a positive integer, null for
     "tokens_per_minute": 200000,       #   "unlimited here", absent for "inherit"
     "concurrent_requests": 20,
     "per_key": {"requests_per_minute": 60},   # the default for each key (or OIDC
                                               # subject) of the tenant; scope tenant only
     "min_priority": -5,                # the request priorities allowed (lower is
     "max_priority": 100,               #   more important; default 0 to 1000)
     "weight": 2}                       # the tenant's share of the engine's batch when
                                        #   tenants compete (default 1); scope tenant only

The scheduling fields (``SCHEDULING_FIELDS``) may be a policy's only fields. By
default a caller may only make its requests less important than the default
(``priority`` 0 to ``PRIORITY_LIMIT``); ``min_priority`` below 0 lets it outrank
other callers. A request that gives no priority gets 0, or ``min_priority`` if
that is above 0.

A ``quota`` policy (UTC calendar periods)::

    {"scope": "tenant", "period": "month", "tokens": 50000000, "per_key": {"tokens": 1000000}}

A ``budget`` policy (the UTC calendar month; ``policy.usage.cost`` prices the spend)::

    {"scope": "tenant", "spend_usd": "250.00", "tokens": 100000000, "per_key": {"spend_usd": "20"}}

Dollars are a decimal string (or an integer), never a JSON float. Unlike a
quota, which refuses a request that would not fit, a budget admits requests
while it is not spent and refuses from 100 %: the request that crosses it runs.

A ``key``-scoped policy names the one it binds in ``principal``: an API key's id
(``key_...``), or a subject as authentication writes it (``key:<prefix>``,
``oidc:<provider>:<sub>``). A policy with no tenant (the global default) must
be tenant-scoped; its limits apply to each tenant separately, not to all of
them together.

Every failure is a ``ValidationFailed`` naming the field (``spec.per_key.tokens``).
Unknown fields are refused rather than ignored: a misspelt limit would
otherwise silently mean "no limit".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.usage.cost import parse_usd

RATE_LIMIT: Final = "rate_limit"
QUOTA: Final = "quota"
BUDGET: Final = "budget"
KINDS: Final = (RATE_LIMIT, QUOTA, BUDGET)

REQUESTS_PER_MINUTE: Final = "requests_per_minute"
TOKENS_PER_MINUTE: Final = "tokens_per_minute"
CONCURRENT_REQUESTS: Final = "concurrent_requests"
TOKENS_PER_DAY: Final = "tokens_per_day"
TOKENS_PER_MONTH: Final = "tokens_per_month"
RATE_FIELDS: Final = (REQUESTS_PER_MINUTE, TOKENS_PER_MINUTE, CONCURRENT_REQUESTS)
# A quota policy's (period, tokens) is stored under one of these, so that a day
# and a month quota are two independent limits like any other pair of fields.
PERIOD_FIELDS: Final = MappingProxyType({"day": TOKENS_PER_DAY, "month": TOKENS_PER_MONTH})
SPEND_PER_MONTH: Final = "spend_micros_per_month"
BUDGET_TOKENS_PER_MONTH: Final = "budget_tokens_per_month"
BUDGET_FIELDS: Final = MappingProxyType({"spend_usd": SPEND_PER_MONTH, "tokens": BUDGET_TOKENS_PER_MONTH})
LIMIT_FIELDS: Final = (*RATE_FIELDS, *PERIOD_FIELDS.values(), *BUDGET_FIELDS.values())

SCOPES: Final = ("tenant", "key")
# Counters must stay exact in Redis' Lua, whose numbers are doubles.
MAX_LIMIT: Final = 10**12
MAX_PRINCIPAL = 300

MIN_PRIORITY: Final = "min_priority"
MAX_PRIORITY: Final = "max_priority"
WEIGHT: Final = "weight"
SCHEDULING_FIELDS: Final = (MIN_PRIORITY, MAX_PRIORITY, WEIGHT)
PRIORITY_LIMIT: Final = 1000  # priorities and their bounds lie within +-this
WEIGHT_RANGE: Final = (0.01, 1000.0)


@dataclass(frozen=True, slots=True)
class LimitPolicy:
    """One validated policy: whom it binds and the limits it sets (by ``LIMIT_FIELDS`` name).

    A field absent from ``limits`` is inherited from the less specific level; a
    field present with None means "unlimited", overriding that level.
    """

    scope: str
    principal: str | None = None
    limits: Mapping[str, int | None] = field(default_factory=dict)
    per_key: Mapping[str, int | None] = field(default_factory=dict)
    scheduling: Mapping[str, int | float] = field(default_factory=dict)  # by SCHEDULING_FIELDS name


def parse_spec(kind: str, spec: Mapping[str, Any], *, is_global: bool = False) -> LimitPolicy:
    """Validate a ``rate_limit`` or ``quota`` spec; ``is_global`` for a policy without a tenant.

    The admin API calls this before ``PolicyStore.create_policy`` or
    ``update_policy``, so a spec that is stored is one the limiter can use.
    """
    if kind not in KINDS:
        raise ValidationFailed(f"kind must be one of {', '.join(KINDS)}", param="kind")
    if not isinstance(spec, Mapping):
        raise ValidationFailed("spec must be a JSON object", param="spec")
    common = {"scope", "principal", "per_key"}
    scheduling: dict[str, int | float] = {}
    if kind == RATE_LIMIT:
        _no_unknown(spec, common | set(RATE_FIELDS) | set(SCHEDULING_FIELDS), "spec")
        scope, principal = _scope(spec, is_global)
        limits = _limits(spec, RATE_FIELDS, "spec")
        per_key = _per_key(spec, scope, RATE_FIELDS)
        scheduling = _scheduling(spec, scope)
    elif kind == BUDGET:
        _no_unknown(spec, common | {"period", *BUDGET_FIELDS}, "spec")
        scope, principal = _scope(spec, is_global)
        if spec.get("period", "month") != "month":
            raise ValidationFailed("spec.period of a budget must be month", param="spec.period")
        limits = _budget(spec, "spec")
        per_key = _budget_per_key(spec, scope)
    else:
        _no_unknown(spec, common | {"period", "tokens"}, "spec")
        scope, principal = _scope(spec, is_global)
        target = _period(spec)
        limits = {target: lim for lim in _limits(spec, ("tokens",), "spec").values()}
        per_key = {target: lim for lim in _per_key(spec, scope, ("tokens",)).values()}

    if not limits and not per_key and not scheduling:
        names = ", ".join(("tokens", "per_key") if kind == QUOTA else (*BUDGET_FIELDS, "per_key") if kind == BUDGET else (*RATE_FIELDS, "per_key", *SCHEDULING_FIELDS))
        raise ValidationFailed(f"spec sets no limit; give at least one of {names}", param="spec")
    return LimitPolicy(scope, principal, MappingProxyType(limits), MappingProxyType(per_key),
                       MappingProxyType(scheduling))  # fmt: skip


def _no_unknown(values: Mapping[str, Any], allowed: set[str], param: str) -> None:
    unknown = sorted(str(name) for name in values if name not in allowed)
    if unknown:
        raise ValidationFailed(
            f"{param} has unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}",
            param=f"{param}.{unknown[0]}",
        )


def _scope(spec: Mapping[str, Any], is_global: bool) -> tuple[str, str | None]:
    scope = spec.get("scope", "tenant")
    if scope not in SCOPES:
        raise ValidationFailed(f"spec.scope must be one of {', '.join(SCOPES)}", param="spec.scope")
    principal = spec.get("principal")
    if scope == "tenant":
        if principal is not None:
            raise ValidationFailed("spec.principal is only for scope 'key'", param="spec.principal")
        return scope, None
    if is_global:
        raise ValidationFailed(
            "a global policy (no tenant) must have scope 'tenant'; use per_key for per-key defaults",
            param="spec.scope",
        )
    if not isinstance(principal, str) or not principal.strip() or len(principal) > MAX_PRINCIPAL:
        raise ValidationFailed(
            f"spec.principal must name the key id or subject the policy binds (1 to {MAX_PRINCIPAL} characters)",
            param="spec.principal",
        )
    if "per_key" in spec:
        raise ValidationFailed("spec.per_key is only for scope 'tenant'", param="spec.per_key")
    return scope, principal


def _period(spec: Mapping[str, Any]) -> str:
    period = spec.get("period")
    if not isinstance(period, str) or period not in PERIOD_FIELDS:
        raise ValidationFailed(f"spec.period must be one of {', '.join(PERIOD_FIELDS)}", param="spec.period")
    return PERIOD_FIELDS[period]


def _per_key(spec: Mapping[str, Any], scope: str, names: tuple[str, ...]) -> dict[str, int | None]:
    if "per_key" not in spec:
        return {}
    per_key = spec["per_key"]
    if not isinstance(per_key, Mapping) or not per_key:
        raise ValidationFailed(
            f"spec.per_key must be an object with at least one of {', '.join(names)}", param="spec.per_key"
        )
    _no_unknown(per_key, set(names), "spec.per_key")
    return _limits(per_key, names, "spec.per_key")


def _budget(values: Mapping[str, Any], param: str) -> dict[str, int | None]:
    out = {BUDGET_FIELDS[name]: v for name, v in _limits(values, ("tokens",), param).items()}
    if "spend_usd" in values:
        value = values["spend_usd"]
        out[SPEND_PER_MONTH] = None if value is None else parse_usd(value, f"{param}.spend_usd", allow_zero=False)
    return out


def _budget_per_key(spec: Mapping[str, Any], scope: str) -> dict[str, int | None]:
    if "per_key" not in spec:
        return {}
    per_key = spec["per_key"]  # _scope refused it for scope key
    if not isinstance(per_key, Mapping) or not per_key:
        raise ValidationFailed("spec.per_key must be an object with spend_usd or tokens", param="spec.per_key")
    _no_unknown(per_key, set(BUDGET_FIELDS), "spec.per_key")
    return _budget(per_key, "spec.per_key")


def _limits(values: Mapping[str, Any], names: tuple[str, ...], param: str) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for name in names:
        if name not in values:
            continue
        value = values[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT):
            raise ValidationFailed(
                f"{param}.{name} must be an integer from 1 to {MAX_LIMIT}, or null for unlimited",
                param=f"{param}.{name}",
            )
        out[name] = value
    return out


def _scheduling(spec: Mapping[str, Any], scope: str) -> dict[str, int | float]:
    """A rate_limit spec's priority bounds and weight, each checked by its own rule."""
    out: dict[str, int | float] = {}
    for name in (MIN_PRIORITY, MAX_PRIORITY):
        if name in spec:
            out[name] = _priority_bound(spec[name], f"spec.{name}")
    if out.get(MIN_PRIORITY, -PRIORITY_LIMIT) > out.get(MAX_PRIORITY, PRIORITY_LIMIT):
        raise ValidationFailed("spec.min_priority must not be above spec.max_priority", param="spec.min_priority")
    if WEIGHT in spec:
        out[WEIGHT] = _weight(spec[WEIGHT], scope)
    return out


def _priority_bound(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -PRIORITY_LIMIT <= value <= PRIORITY_LIMIT:
        raise ValidationFailed(
            f"{param} must be an integer from {-PRIORITY_LIMIT} to {PRIORITY_LIMIT} (lower is more important)",
            param=param,
        )
    return value


def _weight(value: Any, scope: str) -> float:
    # The engine shares its batch between tenants, not keys: a key's weight would mean nothing.
    if scope != "tenant":
        raise ValidationFailed("spec.weight is a tenant's share: only for scope 'tenant'", param="spec.weight")
    low, high = WEIGHT_RANGE
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValidationFailed(f"spec.weight must be a number from {low} to {high:g}", param="spec.weight")
    return float(value)
