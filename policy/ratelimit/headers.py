"""OpenAI's rate-limit headers.

``x-ratelimit-limit-{requests,tokens}`` is the limit, ``-remaining-`` what is
left of it, ``-reset-`` the time until the counter is back at its initial
state, written as a Go duration (``12ms``, ``1.5s``, ``6m0s``). When both the
tenant's and the caller's own limits apply, the headers describe whichever
has less left: that is the one the client will run into.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def duration(seconds: float) -> str:
    """``seconds`` the way OpenAI writes resets: ``0ms``, ``250ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    return f"{minutes}m{secs}" if minutes else secs


def retry_after_seconds(seconds: float) -> int:
    """``Retry-After`` is whole seconds; round up, and never tell a client 0."""
    return max(1, math.ceil(seconds))


@dataclass(frozen=True, slots=True)
class Usage:
    """One counter as the headers show it."""

    limit: int
    remaining: int
    reset: float  # seconds


@dataclass(frozen=True, slots=True)
class RateLimitInfo:
    """The values of the ``x-ratelimit-*`` headers; a None part has no headers (no such limit)."""

    requests: Usage | None = None
    tokens: Usage | None = None

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, usage in (("requests", self.requests), ("tokens", self.tokens)):
            if usage is not None:
                out[f"x-ratelimit-limit-{name}"] = str(usage.limit)
                out[f"x-ratelimit-remaining-{name}"] = str(usage.remaining)
                out[f"x-ratelimit-reset-{name}"] = duration(usage.reset)
        return out


def tightest(usages: list[Usage]) -> Usage | None:
    """The counter with the least left (on a tie, the one that takes longer to reset)."""
    return min(usages, key=lambda u: (u.remaining, -u.reset), default=None)
