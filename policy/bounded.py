"""``remember``: the one bounded cache the request path uses, a dict emptied when full.

The caches it serves (a caller's limits and counters, a policy's decisions,
escaped strings) hold a few entries that recur request after request. Emptying
the dict when it reaches its bound is crude, but it needs no lock, no
bookkeeping per hit, and it refills at once with what recurs.
"""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def remember(cache: dict[K, V], key: K, value: V, max_entries: int) -> V:
    """Keep ``value`` under ``key`` (emptying ``cache`` first if it holds ``max_entries``); returns ``value``."""
    if len(cache) >= max_entries:
        cache.clear()
    cache[key] = value
    return value
