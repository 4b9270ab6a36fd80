"""What the limiter answers besides an admission: a refusal (``Denial``, and the 429 it becomes), the
x-ratelimit-* values of a check's results, and a budget threshold reached (``BudgetCrossing``)."""

from __future__ import annotations

from dataclasses import dataclass

from inferflux.policy.ratelimit.checks import Check, CheckResult, Dimension, Level, bucket_expiry, bucket_of, millis
from inferflux.policy.ratelimit.errors import BudgetExceeded, QuotaExceeded, RateLimited, TokensRateLimited
from inferflux.policy.ratelimit.headers import RateLimitInfo, Usage, duration, retry_after_seconds, tightest
from inferflux.policy.usage.cost import format_usd

@dataclass(frozen=True, slots=True)
class BudgetCrossing:
    """A budget counter reached ``threshold`` percent of its limit in its period (reported once per process;
    ``on_budget``'s receiver makes it once across replicas)."""

    tenant_id: str
    subject: str | None  # the key or subject, for a key-level budget
    dimension: Dimension
    level: Level
    counter: str  # the counter's key, its period included
    limit: int
    used: int
    threshold: int


@dataclass(frozen=True, slots=True)
class Denial:
    """The request must not run: which limit, for whom, and when to try again."""

    dimension: Dimension
    level: Level
    limit: int
    used: int
    requested: int
    retry_after: float  # seconds
    info: RateLimitInfo

    @property
    def headers(self) -> dict[str, str]:
        return {**self.info.headers(), "retry-after": str(retry_after_seconds(self.retry_after))}

    def error(self) -> RateLimited:
        """The 429 to answer with: ``rate_limit_exceeded`` (type requests/tokens) or ``insufficient_quota``."""
        whose = "this tenant" if self.level is Level.TENANT else "this API key or user"
        wait = f"Please try again in {duration(self.retry_after)}."
        if self.dimension in (Dimension.SPEND, Dimension.BUDGET_TOKENS):
            whose_budget = "this tenant" if self.level is Level.TENANT else "this API key or user"
            if self.dimension is Dimension.SPEND:
                what, limit, used = "spend budget", f"${format_usd(self.limit)}", f"${format_usd(self.used)}"
            else:
                what, limit, used = "token budget", f"{self.limit} tokens", f"{self.used} tokens"
            return BudgetExceeded(
                f"The monthly {what} of {whose_budget} is spent: budget {limit}, used {used}. It renews in "
                f"{duration(self.retry_after)} (UTC month), or when an admin raises the budget.",
                headers=self.headers,
            )
        if self.dimension in (Dimension.DAY, Dimension.MONTH):
            period = "day" if self.dimension is Dimension.DAY else "month"
            return QuotaExceeded(
                f"You exceeded the token quota of {whose} for the {period} (UTC): limit {self.limit}, "
                f"used {self.used}, requested {self.requested}. The quota renews in {duration(self.retry_after)}.",
                headers=self.headers,
            )
        if self.dimension is Dimension.CONCURRENCY:
            return RateLimited(
                f"Too many concurrent requests for {whose}: limit {self.limit}. {wait}", headers=self.headers
            )
        unit = "requests" if self.dimension is Dimension.REQUESTS else "tokens"
        if self.requested > self.limit:
            message = (
                f"Request too large for {whose}: it may use {self.requested} tokens, more than the limit of "
                f"{self.limit} tokens per minute. Lower max_tokens or shorten the prompt."
            )
        else:
            message = (
                f"Rate limit reached for {whose} on {unit} per minute: limit {self.limit}, used {self.used}, "
                f"requested {self.requested}. {wait}"
            )
        if self.dimension is Dimension.TOKENS:
            return TokensRateLimited(message, headers=self.headers)
        return RateLimited(message, headers=self.headers)


def usage_of(check: Check, result: CheckResult, charged_at: float | None) -> Usage:
    """A window counter for the headers, including this request's charge if it was admitted."""
    if charged_at is None or check.cost == 0:
        return Usage(check.limit, max(0, check.limit - result.used), result.reset_ms / 1000)
    # The charge went into the current bucket, the newest there is: it sets the reset.
    ends = bucket_expiry(bucket_of(charged_at, check.window, check.buckets), check.window, check.buckets)
    return Usage(check.limit, max(0, check.limit - result.used - check.cost), millis(ends - charged_at) / 1000)


def info_of(checks: tuple[Check, ...], results: list[CheckResult], charged_at: float | None) -> RateLimitInfo:
    """The headers' values; ``charged_at`` is the time of the charge, None if the request was refused."""
    pairs = list(zip(checks, results, strict=True))
    requests = [usage_of(c, r, charged_at) for c, r in pairs if c.dimension is Dimension.REQUESTS]
    tokens = [usage_of(c, r, charged_at) for c, r in pairs if c.dimension is Dimension.TOKENS]
    return RateLimitInfo(tightest(requests), tightest(tokens))


def denial_of(checks: tuple[Check, ...], results: list[CheckResult], info: RateLimitInfo) -> Denial:
    # The request can only pass once every refusing counter has eased: report the slowest.
    check, result = max(
        ((c, r) for c, r in zip(checks, results, strict=True) if not r.allowed), key=lambda p: p[1].retry_after_ms
    )
    retry_after = result.retry_after_ms / 1000
    return Denial(check.dimension, check.level, check.limit, result.used, check.cost, retry_after, info)
