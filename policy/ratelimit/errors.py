"""The rate limiter's client-facing errors, in OpenAI's shapes.

OpenAI answers a rate limit with 429, code ``rate_limit_exceeded`` and a
``type`` naming what ran out (``requests`` or ``tokens``), and an exhausted
quota with 429, code and type ``insufficient_quota``. Clients (the official
SDKs among them) retry the first and not the second, so the split matters.
Each error carries its ``Retry-After`` and ``x-ratelimit-*`` headers.
"""

from __future__ import annotations

from collections.abc import Mapping

from inferflux.policy.errors import PolicyError


class RateLimited(PolicyError):
    """429: too many requests (per minute, or at once); retry after ``Retry-After`` seconds."""

    status_code = 429
    error_type = "requests"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message, headers=headers)


class TokensRateLimited(RateLimited):
    """429: too many tokens per minute."""

    error_type = "tokens"


class QuotaExceeded(RateLimited):
    """429: the token quota of the day or month is spent; not worth retrying before it renews."""

    error_type = "insufficient_quota"
    default_code = "insufficient_quota"


class RateLimiterUnavailable(PolicyError):
    """503: the shared limit store (Redis) is down and the limiter is configured to fail closed."""

    status_code = 503
    error_type = "server_error"
    default_code = "rate_limiter_unavailable"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after)})


class BudgetExceeded(QuotaExceeded):
    """429: a monthly spend or token budget is spent (100 %); refused until the month renews or an admin raises it."""

    default_code = "budget_exceeded"
