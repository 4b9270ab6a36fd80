"""``AuditTrail``: the one object the gateway holds — spool, sink deliveries and live tail together.

::

    trail = AuditTrail(Spool.open(SpoolSettings(dir)), [SyslogSink(...), IndexerSink(store)]).start()
    await trail.record(api_event(...))        # returns once the event is written (or fsynced: wait_durable)
    subscription = trail.subscribe(tenant)    # for GET /admin/v1/audit/stream
    trail.close()                             # at shutdown

Refusals go through ``record_refusal``, which writes the first of a caller's
repeated refusals at once and counts the rest (``policy.audit.refusals``); a
housekeeping thread writes the counts when their window ends and signed
checkpoints of the chain's head when they are due (``policy.audit.checkpoint``).

``record`` returns once the event is sealed into the chain and written to the
spool file, on the caller's thread: from then on it is in the kernel, so a
response sent after it is an acknowledged request whose event survives a crash
or ``kill -9`` of the gateway. The syncer thread fsyncs within a moment (one
fsync per batch, at most one per the spool's ``sync_interval_seconds``). With
``wait_durable`` (and an interval of 0) ``record`` also waits for that fsync,
so the event survives a crash of the machine or a power cut too; that costs a
disk flush of latency on every answer (0.1-0.9 ms on the virtual disks we
measured, more on slow ones), which is why it is an option.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from typing import Any

from inferflux.policy.audit.checkpoint import Checkpointer
from inferflux.policy.audit.delivery import Backoff, Delivery, Sink, Worker
from inferflux.policy.audit.errors import AuditUnavailable
from inferflux.policy.audit.events import AuditEvent
from inferflux.policy.audit.refusals import RefusalAggregator
from inferflux.policy.audit.spool import Receipt, Spool
from inferflux.policy.audit.tail import LiveTail, Subscription

log = logging.getLogger("inferflux.policy.audit")


class AuditTrail:
    def __init__(
        self,
        spool: Spool,
        sinks: Sequence[Sink] = (),
        *,
        wait_durable: bool = False,
        tail: LiveTail | None = None,
        backoff: Backoff = Backoff(),
        batch_size: int = 500,
        linger_seconds: float = 0.0,
        refusals: RefusalAggregator | None = None,
        checkpointer: Checkpointer | None = None,
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
        self.refusals = refusals if refusals is not None else RefusalAggregator(10.0)
        self.checkpointer = checkpointer
        self._housekeeping = _Housekeeping(self)

    def start(self) -> AuditTrail:
        for delivery in self.deliveries:
            delivery.start()
        self._housekeeping.start()
        return self

    async def record(self, event: AuditEvent) -> None:
        """Spool ``event`` (with ``wait_durable``, until fsynced). AuditUnavailable (503) if it cannot be."""
        receipt = self.spool.append(event)
        if self.wait_durable:
            await receipt
        else:
            receipt.raise_if_failed()  # a failed write is known at once; an answer must not outlive it

    def record_nowait(self, event: AuditEvent) -> Receipt:
        """Spool ``event`` and return its receipt without waiting (for callers that wait elsewhere)."""
        return self.spool.append(event)

    async def record_refusal(self, key: tuple[Hashable, ...], event: AuditEvent) -> bool:
        """Record a refusal: at once if it is the first of ``key`` (caller, route, status, reason) in its
        window, else counted into the window's aggregate. Whether it was written now."""
        if not self.refusals.admit(key, event):
            return False
        await self.record(event)
        return True

    def housekeep(self, *, final: bool = False) -> None:
        """Write the aggregates of ended refusal windows and a checkpoint if one is due (``final``: all of them)."""
        for event in self.refusals.due(everything=final):
            try:
                self.spool.append(event)
            except AuditUnavailable as exc:
                log.error("aggregated audit refusals (%s) not recorded: %s", event.detail, exc.message)
        if self.checkpointer is not None:
            if final:  # the last checkpoint covers everything written: let the syncer make it durable first
                deadline = time.monotonic() + 5.0
                while self.spool.stats.pending and time.monotonic() < deadline:
                    time.sleep(0.005)
            self.checkpointer.run_once(force=final)

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
        self._housekeeping.stop(timeout)
        if not self.spool.closed:
            self.housekeep(final=True)  # the counts of open windows and a last checkpoint
        self.tail.close()
        self.spool.close(timeout)
        for delivery in self.deliveries:
            delivery.stop(timeout)


class _Housekeeping(Worker):
    """Calls ``trail.housekeep()`` every tick: a quarter of the shortest interval it serves, 0.05 to 1 s."""

    def __init__(self, trail: AuditTrail) -> None:
        super().__init__("audit-housekeeping")
        self._trail = trail
        intervals = [trail.refusals.window_seconds or 1.0]
        if trail.checkpointer is not None:
            intervals.append(trail.checkpointer.every_seconds)
        self._tick = min(1.0, max(0.05, min(intervals) / 4))

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            try:
                self._trail.housekeep()
            except Exception:  # never let the thread die: the next tick tries again
                log.exception("audit housekeeping failed")
