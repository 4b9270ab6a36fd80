"""One upstream endpoint's health: what the active check saw, its circuit breaker, its load.

An endpoint is used only while it is healthy (its last active check got an
answer), its circuit is closed (or half-open with the one probe slot free)
and it is under its in-flight cap. The breaker learns from real requests
(passive health): ``breaker_failures`` consecutive failures open it, so a
dead endpoint stops costing every request a connect attempt; after
``breaker_reset_seconds`` it lets one request through, whose answer closes
it again or reopens it for another period.

Times come from an injectable clock, so tests move a breaker through its
states without waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

Circuit = Literal["closed", "open", "half_open"]


@dataclass(frozen=True, slots=True)
class EndpointStatus:
    """A snapshot of one endpoint, for metrics and the admin view (no credential, errors scrubbed)."""

    url: str
    healthy: bool  # the last active check got an answer (True until a check says otherwise)
    circuit: Circuit
    inflight: int  # requests holding a slot now
    requests: int  # attempts sent to it, retries included
    failures: int  # attempts that failed (connect error, 5xx, timeout, cut stream), ever
    last_error: str | None  # the latest failure's kind, e.g. "HTTP 502", "connect error"


class EndpointState:
    """The mutable state behind an ``EndpointStatus``; used from one event loop only."""

    def __init__(self, url: str, *, cap: int, breaker_failures: int, breaker_reset_seconds: float,
                 clock: Callable[[], float]) -> None:  # fmt: skip
        self.url = url
        self.cap = cap
        self.breaker_failures = breaker_failures
        self.breaker_reset_seconds = breaker_reset_seconds
        self.clock = clock
        self.healthy = True
        self.inflight = 0
        self.requests = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.opened_at: float | None = None  # when the circuit last opened; None while closed
        self.probing = False  # the half-open circuit's one request is out

    @property
    def circuit(self) -> Circuit:
        if self.opened_at is None:
            return "closed"
        if self.clock() - self.opened_at >= self.breaker_reset_seconds:
            return "half_open"
        return "open"

    def half_opens_in(self) -> float | None:
        """Seconds until an open circuit lets a probe through; None unless it is open."""
        if self.opened_at is None:
            return None
        left = self.opened_at + self.breaker_reset_seconds - self.clock()
        return left if left > 0 else None

    def available(self) -> bool:
        """Whether a new request may be sent here now."""
        if not self.healthy or self.inflight >= self.cap:
            return False
        circuit = self.circuit
        return circuit == "closed" or (circuit == "half_open" and not self.probing)

    def acquire(self) -> bool:
        """Take a slot for one attempt (``available`` must hold); True when it is the half-open probe."""
        self.inflight += 1
        self.requests += 1
        if self.opened_at is not None:  # half-open: this attempt is the probe
            self.probing = True
            return True
        return False

    def release(self, probe: bool) -> None:
        self.inflight -= 1
        if probe:
            self.probing = False

    def succeeded(self) -> None:
        """The upstream answered 2xx: the endpoint works, whatever its circuit said."""
        self.consecutive_failures = 0
        self.opened_at = None

    def failed(self, kind: str) -> None:
        """An attempt failed for a reason of the endpoint's (not the request's): count it toward the breaker."""
        self.failures += 1
        self.consecutive_failures += 1
        self.last_error = kind
        if self.opened_at is not None or self.consecutive_failures >= self.breaker_failures:
            # A failed probe (or any failure while not closed) starts a new open period.
            if self.opened_at is None:
                log.warning("upstream endpoint %s: circuit open after %d failures in a row (latest: %s)",
                            self.url, self.consecutive_failures, kind)  # fmt: skip
            self.opened_at = self.clock()

    def status(self) -> EndpointStatus:
        return EndpointStatus(
            url=self.url,
            healthy=self.healthy,
            circuit=self.circuit,
            inflight=self.inflight,
            requests=self.requests,
            failures=self.failures,
            last_error=self.last_error,
        )
