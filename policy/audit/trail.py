"""``AuditTrail``: the one object the gateway holds — spool, sink deliveries and live tail together.

::

    trail = AuditTrail(Spool.open(SpoolSettings(dir)), [SyslogSink(...), IndexerSink(store)]).start()
    await trail.record(api_event(...))        # returns once the event is durable (wait_durable)
    subscription = trail.subscribe(tenant)    # for GET /admin/v1/audit/stream
    trail.close()                             # at shutdown

With ``wait_durable`` (the default, and what the acceptance needs) ``record``
returns only after the fsync, so a response sent after it is an acknowledged
request whose event survives ``kill -9``. Without it, ``record`` returns after
the enqueue and a crash can lose the last few milliseconds of events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from policy.audit.delivery import Backoff, Delivery, Sink
from policy.audit.events import AuditEvent
from policy.audit.spool import Receipt, Spool
from policy.audit.tail import LiveTail, Subscription


class AuditTrail:
    def __init__(
        self,
        spool: Spool,
        sinks: Sequence[Sink] = (),
        *,
        wait_durable: bool = True,
        tail: LiveTail | None = None,
        backoff: Backoff = Backoff(),
        batch_size: int = 500,
        linger_seconds: float = 0.0,
    ) -> None:
        names = [sink.name for sink in sinks]
        if len(set(names)) != len(names):
            raise ValueError("audit sinks need distinct names: each keeps its own cursor under its name")
        self.spool = spool
        self.wait_durable = wait_durable
        self.tail = tail or LiveTail()
        spool.add_listener(self.tail.publish)
        self.deliveries = [
            Delivery(spool, sink, backoff=backoff, batch_size=batch_size, linger_seconds=linger_seconds)
            for sink in sinks
        ]

    def start(self) -> AuditTrail:
        for delivery in self.deliveries:
            delivery.start()
        return self

    async def record(self, event: AuditEvent) -> None:
        """Spool ``event``; with ``wait_durable``, return once it is on disk. AuditUnavailable (503) if it cannot be."""
        receipt = self.spool.append(event)
        if self.wait_durable:
            await receipt

    def record_nowait(self, event: AuditEvent) -> Receipt:
        """Spool ``event`` and return its receipt without waiting (for callers that wait elsewhere)."""
        return self.spool.append(event)

    def subscribe(self, tenant: str | None) -> Subscription:
        """A live subscription scoped to ``tenant`` (None: every tenant, for platform admins only)."""
        return self.tail.subscribe(tenant)

    def status(self) -> dict[str, Any]:
        """Counters for metrics and health: the spool's, and each sink's delivery (no secrets)."""
        stats = self.spool.stats
        return {
            "chain": self.spool.chain_id,
            "spool": {"events": stats.events, "batches": stats.batches, "fsyncs": stats.fsyncs,
                      "pending": stats.pending, "failed": stats.failed},
            "sinks": {
                d.name: {"delivered": s.delivered, "failures": s.failures, "last_error": s.last_error,
                         "caught_up": d.caught_up()}
                for d in self.deliveries
                for s in (d.stats,)
            },
        }  # fmt: skip

    def close(self, timeout: float = 10.0) -> None:
        """End live subscriptions, write what is queued, stop the sinks (each tries what it has once more; what a
        sink does not take then goes after a restart)."""
        self.tail.close()
        self.spool.close(timeout)
        for delivery in self.deliveries:
            delivery.stop(timeout)
