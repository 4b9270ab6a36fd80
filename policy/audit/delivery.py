"""Delivery: one thread per sink moves durable records from the spool to the sink.

Each sink has its own cursor in the spool. A batch is read after the cursor,
sent, and only then is the cursor saved, so a crash between the two sends the
batch again after restart: delivery is at-least-once, and duplicates carry
the same event id (and chain seq) for the receiver to drop. A failing sink is
retried with exponential back-off and full jitter (so many replicas do not
retry in step), capped at 2 s so a sink that returns gets its backlog at once;
it holds back only its own cursor, never the writer or the other sinks.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, Self

from inferflux.policy.audit.spool import Cursor, Spool, SpooledRecord

log = logging.getLogger("inferflux.policy.audit")


class _Stopped(Exception):
    """Stop was asked for while a batch was still being retried."""


class Sink(Protocol):
    """Where records go. ``send`` delivers the whole batch or raises (any Exception: it is retried)."""

    name: str

    def send(self, records: Sequence[SpooledRecord]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential back-off with full jitter: attempt n waits uniformly in [0, min(maximum, initial·factorⁿ)].

    The cap is short on purpose: however long a sink was away, the next attempt is
    at most ``maximum`` seconds off, so a sink that comes back receives its backlog
    within a few seconds. What it costs: a sink that stays down gets an attempt
    every second on average from each replica (a connection refused, or an error
    answer; an attempt that hangs waits for the sink's own timeout first).
    """

    initial: float = 0.2
    maximum: float = 2.0
    factor: float = 2.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        ceiling = min(self.maximum, self.initial * self.factor ** min(attempt, 64))
        return (rng or random).uniform(0.0, ceiling)


@dataclass(frozen=True, slots=True)
class DeliveryStats:
    delivered: int  # records sent (re-deliveries after a restart count again)
    batches: int
    failures: int  # failed attempts
    last_error: str | None  # the last failure's type and message; sinks keep secrets out of it
    cursor: Cursor


class Worker:
    """A daemon thread that runs ``_run`` until ``stop()`` sets ``_stop``."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        raise NotImplementedError


class Delivery(Worker):
    """Feeds one sink from the spool on a thread of its own: ``start()``, ``stop()``."""

    def __init__(
        self,
        spool: Spool,
        sink: Sink,
        *,
        batch_size: int = 500,
        backoff: Backoff = Backoff(),
        poll_seconds: float = 0.5,
        linger_seconds: float = 0.0,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError("batch_size must be a positive integer")
        if isinstance(linger_seconds, bool) or not isinstance(linger_seconds, int | float) or not (
            0 <= linger_seconds <= 60
        ):
            raise ValueError("linger_seconds must be a number from 0 to 60")
        super().__init__(f"audit-sink-{sink.name}")
        self.spool = spool
        self.sink = sink
        self.name = sink.name
        self._batch_size = batch_size
        self._backoff = backoff
        self._poll = poll_seconds
        self._linger = float(linger_seconds)
        self._lock = threading.Lock()
        self._cursor = spool.register_sink(self.name)
        self._delivered = self._batches = self._failures = 0
        self._last_error: str | None = None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the batch in flight (an unfinished one is sent again next start) and close the sink."""
        super().stop(timeout)
        self.sink.close()

    @property
    def stats(self) -> DeliveryStats:
        with self._lock:
            return DeliveryStats(self._delivered, self._batches, self._failures, self._last_error, self._cursor)

    def caught_up(self) -> bool:
        """Whether everything durable in the spool has been delivered."""
        with self._lock:
            return self._cursor >= self.spool.durable_cursor()

    def wait_caught_up(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.caught_up():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _run(self) -> None:
        cursor = self._cursor
        failures = 0
        while not self._stop.is_set():
            try:
                cursor = self._step(cursor)
                failures = 0
            except _Stopped:
                return
            except Exception as exc:  # the spool's disk, not the sink: wait and go on, never die
                log.error("audit sink %s: reading the spool failed: %s", self.name, exc)
                self._stop.wait(self._backoff.delay(failures))
                failures += 1

    def _step(self, cursor: Cursor) -> Cursor:
        if self._linger and self.spool.wait_beyond(cursor, self._poll):
            # Let a batch gather: one send, one store commit and one cursor write for
            # many events, instead of a burst of work beside every request.
            self._stop.wait(self._linger)
        records, after = self.spool.read(cursor, self._batch_size, wait=self._poll)
        if records and not self._send(records):
            raise _Stopped
        if after == cursor:
            if self.spool.closed:  # read() no longer waits: do not spin until stop()
                self._stop.wait(self._poll)
            return cursor
        self.spool.save_cursor(self.name, after)
        if after.segment != cursor.segment:
            self.spool.prune()
        with self._lock:
            self._cursor = after
            self._delivered += len(records)
            self._batches += 1 if records else 0
        return after

    def _send(self, records: list[SpooledRecord]) -> bool:
        """Send with retries until it succeeds; once stopping, one attempt (a batch gathered
        during the linger still goes out at shutdown if the sink takes it)."""
        attempt = 0
        while True:
            try:
                self.sink.send(records)
                return True
            except Exception as exc:  # any failure of a sink is retried; the spool keeps the records
                delay = self._backoff.delay(attempt)
                message = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self._failures += 1
                    self._last_error = message
                if self._stop.is_set():
                    log.warning("audit sink %s: delivery failed (%s); stopping, the rest goes after a restart",
                                self.name, message)
                    return False
                log.warning("audit sink %s: delivery failed (%s); retry in %.2fs", self.name, message, delay)
                attempt += 1
                self._stop.wait(delay)
