"""One upstream endpoint's health: what the active check saw, its circuit breaker, its load.

An endpoint is used only while it is healthy (its last active check got an
answer), its circuit is closed (or half-open with the one probe slot free)
and it is under its in-flight cap. The breaker learns from real requests
(passive health): ``breaker_failures`` consecutive failures open it, so a
dead endpoint stops costing every request a connect attempt; after
``breaker_reset_seconds`` it lets one request through, whose answer closes
it again or reopens it for another period.

Times come from an injectable clock, so tests move a breaker through its
states without waiting. ``check`` is the active check of one endpoint, which
the fleet runs on every endpoint each interval; ``retry_after`` is what a
refusal tells the client to wait, from the endpoints' states.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from inferflux.backends.openai.transport import ConnectFailed, ConnectionLost, TimedOut, Transport

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


async def check(endpoint: EndpointState, transport: Transport, timeout: float, max_body: int) -> None:
    """``GET {base}/models``: an answer below 500 means the server is up (a 401 is about the key)."""
    for _attempt in range(2):
        try:
            status = await transport.get_status(endpoint.url + "/models", timeout, max_body)
            healthy, why = status < 500, f"HTTP {status}"
        except ConnectionLost:
            # A pooled connection the server closed just then: not a dead server, ask once more.
            healthy, why = False, "connection lost"
            continue
        except (ConnectFailed, TimedOut, TimeoutError, OSError) as exc:
            healthy, why = False, type(exc).__name__
        except Exception as exc:  # anything else must not end the loop that checks every endpoint
            log.exception("upstream endpoint %s: the health check failed unexpectedly", endpoint.url)
            healthy, why = False, type(exc).__name__
        break
    if healthy != endpoint.healthy:
        state = "healthy again" if healthy else "unhealthy"
        log.warning("upstream endpoint %s is %s (%s)", endpoint.url, state, why)
    endpoint.healthy = healthy


def retry_after(endpoints: Sequence[EndpointState]) -> float:
    """Seconds until retrying is worth it: 1 when an endpoint is only full, else the soonest half-open."""
    waits = []
    for endpoint in endpoints:
        opens_in = endpoint.half_opens_in()
        if opens_in is not None:
            waits.append(opens_in)
        elif endpoint.healthy:
            return 1.0  # full (or its probe is out): slots free up as requests finish
    return max(0.1, min(waits)) if waits else 1.0
