"""Live tail: durable records fanned out to async subscribers (``GET /admin/v1/audit/stream``).

``LiveTail.publish`` is a spool listener: it runs on the spool's writer
thread after each fsynced batch, so subscribers see only acknowledged events,
in chain order. It never blocks: each subscriber has a bounded buffer, and one
that falls ``max_buffer`` records behind is cut off. Its iterator then yields a
``Dropped`` marker and ends, and the client reconnects (and reads the gap from
the store).

Scope is the caller's business to decide and this module's to enforce: a
subscription with a tenant sees only that tenant's events; ``tenant=None``
(platform admins only) sees every event, platform-level admin actions included.
Subscriptions are bounded per replica and per tenant, so no tenant can take
every slot and lock the others out of their own live tail.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from inferflux.policy.audit.chain import canonical_json
from inferflux.policy.audit.errors import AuditUnavailable, TooManySubscriptions
from inferflux.policy.audit.spool import SpooledRecord


RETRY_AFTER_SECONDS = 5


@dataclass(frozen=True, slots=True)
class Dropped:
    """The last item of a subscription that fell too far behind."""

    reason: str
    last_seq: int | None  # the last record it was given (None: none yet)

    def to_json(self) -> dict[str, Any]:
        return {"dropped": True, "reason": self.reason, "last_seq": self.last_seq}


class Subscription:
    """An async iterator of records (dicts as spooled), ending with ``Dropped`` if it was too slow."""

    def __init__(self, tail: LiveTail, tenant: str | None, max_buffer: int) -> None:
        self.tenant = tenant
        self._tail = tail
        self._max = max_buffer
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._buffer: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()
        self._dropped: Dropped | None = None
        self._closed = False
        self._last_seq: int | None = None

    def _offer(self, records: Sequence[SpooledRecord]) -> None:
        """On the writer thread: buffer what this subscriber may see, or cut it off."""
        wanted = [r.record for r in records if self.tenant is None or r.event.get("tenant_id") == self.tenant]
        if not wanted:
            return
        with self._lock:
            if self._dropped is not None or self._closed:
                return
            if len(self._buffer) + len(wanted) > self._max:
                self._dropped = Dropped("subscriber too slow: more than %d events behind" % self._max, self._last_seq)
                self._buffer.clear()
            else:
                self._buffer.extend(wanted)
                self._last_seq = wanted[-1].get("seq")
        try:
            self._loop.call_soon_threadsafe(self._wakeup.set)
        except RuntimeError:  # its loop is gone
            self._tail._remove(self)

    def __aiter__(self) -> AsyncIterator[dict[str, Any] | Dropped]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[dict[str, Any] | Dropped]:
        try:
            while True:
                with self._lock:
                    items = list(self._buffer)
                    self._buffer.clear()
                    dropped = self._dropped
                    self._wakeup.clear()
                for item in items:
                    yield item
                if dropped is not None:
                    yield dropped
                    return
                if self._closed:
                    return
                if not items:
                    await self._wakeup.wait()
        finally:
            self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._tail._remove(self)
        try:
            self._loop.call_soon_threadsafe(self._wakeup.set)
        except RuntimeError:  # its loop is gone, and with it whoever iterated
            pass


class LiveTail:
    """Fan-out of durable records. ``spool.add_listener(tail.publish)``, then ``tail.subscribe(tenant)``."""

    def __init__(self, max_buffer: int = 1000, max_subscribers: int = 100, max_per_tenant: int = 10) -> None:
        self._max_buffer = max_buffer
        self._max_subscribers = max_subscribers
        self._max_per_tenant = max_per_tenant
        self._lock = threading.Lock()
        self._subscribers: list[Subscription] = []

    def subscribe(self, tenant: str | None) -> Subscription:
        """A subscription to ``tenant``'s events (None: all). Call from the event loop that will iterate it.

        Raises TooManySubscriptions (429) when ``tenant`` holds ``max_per_tenant``
        already, and AuditUnavailable (503) when ``max_subscribers`` are listening
        in all. Platform-wide subscriptions (None) count only towards the latter.
        """
        subscription = Subscription(self, tenant, self._max_buffer)
        with self._lock:
            if tenant is not None and sum(s.tenant == tenant for s in self._subscribers) >= self._max_per_tenant:
                raise TooManySubscriptions(
                    f"This tenant has {self._max_per_tenant} live audit subscriptions open already; "
                    "close one or retry later",
                    headers={"retry-after": str(RETRY_AFTER_SECONDS)},
                )
            if len(self._subscribers) >= self._max_subscribers:
                raise AuditUnavailable("Too many live audit subscribers; retry later")
            self._subscribers.append(subscription)
        return subscription

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._subscribers)

    def publish(self, records: Sequence[SpooledRecord]) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for subscription in subscribers:
            subscription._offer(records)

    def close(self) -> None:
        """End every subscription (at shutdown)."""
        with self._lock:
            subscribers, self._subscribers = self._subscribers, []
        for subscription in subscribers:
            subscription.close()

    def _remove(self, subscription: Subscription) -> None:
        with self._lock:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)


def sse_message(item: dict[str, Any] | Dropped) -> bytes:
    """One subscription item as a server-sent event: ``event: audit`` with the record as spooled
    (``id`` is chain:seq), or ``event: dropped`` as the last one of a subscriber that fell behind."""
    if isinstance(item, Dropped):
        return b"event: dropped\ndata: " + canonical_json(item.to_json()) + b"\n\n"
    ident = f"{item.get('chain')}:{item.get('seq')}".encode()
    return b"id: " + ident + b"\nevent: audit\ndata: " + canonical_json(item) + b"\n\n"
