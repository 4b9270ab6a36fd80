"""Console sign-in throttling: a source that failed to sign in too often waits before it may try again.

The sign-in form takes an API key, so without a bound it is a free oracle for
guessing one. Each source (the client's address; an IPv6 client's /64, which
one subscriber usually holds whole) may fail ``failures`` times within
``window`` seconds; past that every attempt from it, right or wrong, is answered
429 with ``Retry-After`` (the seconds until its oldest failure leaves the
window) without the key being checked. A successful sign-in forgets the
source's failures. The state is bounded: at most ``max_sources`` sources are
remembered, the least recently seen forgotten first, each with at most
``failures`` timestamps.

What it costs: clients behind one address (a NAT, a proxy that is not trusted
for ``X-Forwarded-For``) share one allowance, so one of them failing often
makes the others wait too; an attacker with many addresses gets an allowance
for each (the keys' 256 random bits, not this, are what make guessing hopeless).
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

DEFAULT_FAILURES = 5
DEFAULT_WINDOW_SECONDS = 60.0
MAX_SOURCES = 10_000


def source_of(client: tuple[str, int] | None) -> str:
    """The throttled unit for a client address: the address, or its /64 for IPv6."""
    if not client:
        return "unknown"
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return str(client[0])[:64]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(address) >> 64 << 64, 64)))
    return str(address)


class SignInThrottle:
    """Failed sign-ins per source in a sliding window; used from the event loop only."""

    def __init__(self, failures: int = DEFAULT_FAILURES, window: float = DEFAULT_WINDOW_SECONDS, *,
                 max_sources: int = MAX_SOURCES, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.failures = failures
        self.window = window
        self.max_sources = max_sources
        self._clock = clock
        self._recent: OrderedDict[str, deque[float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._recent)

    def retry_after(self, source: str) -> int | None:
        """Whole seconds until ``source`` may try again, or None if it may now."""
        times = self._recent.get(source)
        if times is None:
            return None
        now = self._clock()
        while times and times[0] <= now - self.window:
            times.popleft()
        if not times:
            del self._recent[source]
            return None
        if len(times) < self.failures:
            return None
        return max(1, math.ceil(times[0] + self.window - now))

    def failed(self, source: str) -> None:
        """One more failure from ``source``."""
        times = self._recent.get(source)
        if times is None:
            times = self._recent[source] = deque(maxlen=self.failures)
            while len(self._recent) > self.max_sources:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(source)
        times.append(self._clock())

    def succeeded(self, source: str) -> None:
        """``source`` signed in: its failures are forgotten."""
        self._recent.pop(source, None)
