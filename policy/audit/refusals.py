"""Refusals on the audit trail, aggregated so that a flood cannot fill the disk.

Every refused call (401, 403, 404, 422, 429, ...) is an audit event, but a
client sending a thousand forged tokens a second must not write a thousand
events a second. ``RefusalAggregator`` keeps one window per *key* (the
caller, the route, the status and the reason):

* the first refusal of a key is written at once, as a full event;
* repeats within ``window_seconds`` of it are only counted;
* when the window ends (or the trail closes) the count is written as one
  event, a copy of the first with ``detail`` = ``{"aggregated": n,
  "first_at", "last_at", "window_seconds"}``, and the key starts afresh.

So a steady flood costs at most two events per key and window. The caller
is the gateway's to choose (``gateway.audit.refusal_key``: the principal, or
the client's address when authentication failed, since forged credentials
vary at will); the aggregate names it. Even addresses and routes are many, so
at most ``max_keys`` windows are open at once; refusals of further keys share
one window per status and reason (``OVERFLOW``), whose aggregate names no caller.

Thread-safe: the event loop admits, the trail's housekeeping thread collects
what is due.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Final

from inferflux.policy.audit.events import AuditEvent, new_event_id

OVERFLOW: Final = "*overflow*"


@dataclass(slots=True)
class _Window:
    key: tuple[Hashable, ...]
    first: AuditEvent
    opened: float  # clock() when the first refusal came
    overflow: bool
    repeats: int = 0
    first_repeat_at: datetime | None = None
    last_at: datetime | None = None


class RefusalAggregator:
    def __init__(
        self, window_seconds: float, *, max_keys: int = 4096, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if isinstance(window_seconds, bool) or not isinstance(window_seconds, int | float) or window_seconds < 0:
            raise ValueError("the refusal aggregation window must be a non-negative number of seconds")
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
            raise ValueError("max_keys must be a positive integer")
        self.window_seconds = float(window_seconds)
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[Hashable, _Window] = {}
        self._closed_windows: list[_Window] = []  # ended with repeats, waiting to be written

    def admit(self, key: tuple[Hashable, ...], event: AuditEvent) -> bool:
        """True: write ``event`` now (the first of its key in a window). False: it was counted.

        ``key`` is (caller, route, ...): the overflow window keeps what follows those two.
        """
        if self.window_seconds == 0:
            return True
        now = self._clock()
        with self._lock:
            window = self._windows.get(key)
            if window is None and len(self._windows) >= self.max_keys:
                key = (OVERFLOW, *key[2:])  # keep the status and reason, drop the caller and route
                window = self._windows.get(key)
            if window is not None and now - window.opened >= self.window_seconds:
                del self._windows[key]
                if window.repeats:
                    self._closed_windows.append(window)
                window = None
            if window is None:
                self._windows[key] = _Window(key, event, now, overflow=key[0] == OVERFLOW)
                return True
            window.repeats += 1
            window.last_at = event.at
            if window.first_repeat_at is None:
                window.first_repeat_at = event.at
            return False

    def due(self, *, everything: bool = False) -> list[AuditEvent]:
        """The aggregate events of windows that ended (``everything``: of every window, at shutdown)."""
        now = self._clock()
        with self._lock:
            ended = self._closed_windows
            self._closed_windows = []
            for key, window in list(self._windows.items()):
                if everything or now - window.opened >= self.window_seconds:
                    del self._windows[key]
                    if window.repeats:
                        ended.append(window)
        return [self._aggregate(window) for window in ended]

    def open_windows(self) -> int:
        with self._lock:
            return len(self._windows)

    def _aggregate(self, window: _Window) -> AuditEvent:
        last = window.last_at or window.first.at
        detail: dict[str, object] = {
            "aggregated": window.repeats,
            "first_at": _iso(window.first_repeat_at or last),
            "last_at": _iso(last),
            "window_seconds": self.window_seconds,
        }
        # What differs between the repeats (their content, tokens, timing) is not the first one's.
        counted = replace(window.first, id=new_event_id(), at=last, request_id=None, findings=(),
                          prompt_hmac=None, completion_hmac=None, prompt_text=None, completion_text=None,
                          prompt_tokens=None, completion_tokens=None, latency_ms=None)  # fmt: skip
        if window.overflow:  # many callers and routes: none of them is named
            detail["callers"] = "many"
            return replace(counted, principal=None, key_id=None, tenant_id=None, route=None, detail=detail)
        # The key's caller: the first refusal may name more (a presented key's prefix) than the repeats share.
        return replace(counted, principal=str(window.key[0]) or None, detail={**(window.first.detail or {}), **detail})


def _iso(value: datetime) -> str:
    return value.isoformat(timespec="microseconds").replace("+00:00", "Z")
