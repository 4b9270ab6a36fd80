"""Rate limits, concurrency limits and token quotas, per tenant and per key or user.

Limits are ``rate_limit`` and ``quota`` policies in the store (``spec``);
``PolicyResolver`` turns them into a principal's ``EffectiveLimits``;
``RateLimiter`` admits or refuses each request against them and settles the
real token counts afterwards, on a ``MemoryBackend`` (one replica) or a
``RedisBackend`` (several). See ``limiter`` for the request-path contract.

``RedisBackend`` is imported on first use, so a single replica never loads redis-py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inferflux.policy.ratelimit.checks import Backend, BackendUnavailable, Dimension, Level
from inferflux.policy.ratelimit.errors import BudgetExceeded, QuotaExceeded, RateLimited, RateLimiterUnavailable, TokensRateLimited
from inferflux.policy.ratelimit.headers import RateLimitInfo, Usage
from inferflux.policy.ratelimit.limiter import Admission, BudgetCrossing, Denial, FixedLimits, Handle, LimitSource, RateLimiter
from inferflux.policy.ratelimit.memory import MemoryBackend
from inferflux.policy.ratelimit.resolver import (
    DEFAULT_SCHEDULING,
    UNLIMITED,
    EffectiveLimits,
    Limits,
    PolicyResolver,
    Scheduling,
    compile_policies,
    effective_limits,
)
from inferflux.policy.ratelimit.spec import KINDS, LimitPolicy, parse_spec

if TYPE_CHECKING:
    from inferflux.policy.ratelimit.redis_backend import RedisBackend

__all__ = [
    "DEFAULT_SCHEDULING",
    "KINDS",
    "UNLIMITED",
    "Admission",
    "Backend",
    "BackendUnavailable",
    "BudgetCrossing",
    "BudgetExceeded",
    "Denial",
    "Dimension",
    "EffectiveLimits",
    "FixedLimits",
    "Handle",
    "Level",
    "LimitPolicy",
    "LimitSource",
    "Limits",
    "MemoryBackend",
    "PolicyResolver",
    "QuotaExceeded",
    "RateLimitInfo",
    "RateLimited",
    "RateLimiter",
    "RateLimiterUnavailable",
    "RedisBackend",
    "Scheduling",
    "TokensRateLimited",
    "Usage",
    "compile_policies",
    "effective_limits",
    "parse_spec",
]


def __getattr__(name: str) -> Any:
    if name == "RedisBackend":
        from inferflux.policy.ratelimit.redis_backend import RedisBackend

        return RedisBackend
    raise AttributeError(f"module 'inferflux.policy.ratelimit' has no attribute {name!r}")
