"""Receipts: how the caller of ``Spool.append`` learns that its event is durable (or lost).

The spool's syncer thread resolves receipts; waiters are threads (``wait``)
or event loops (``await``). Resolving a batch wakes each waiting event loop
once for all of its receipts: under load one fsync covers hundreds of
events, and a ``call_soon_threadsafe`` per event would cost the loop more
than the events' writes did.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from inferflux.policy.audit.errors import AuditUnavailable


class Receipt:
    """The acknowledgement of one appended event: resolves once it is durable (fsynced), or failed.

    ``wait()`` from a thread, ``await receipt`` from asyncio. A failed receipt
    raises ``AuditUnavailable``. One is made per request, and most are never
    waited for: the event a waiting thread blocks on is made only when one does.
    """

    __slots__ = ("event_id", "seq", "_done", "_error", "_lock", "_waiters", "_event")

    def __init__(self, event_id: str) -> None:
        self.event_id = event_id
        self.seq: int | None = None
        self._done = False
        self._error: AuditUnavailable | None = None
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._event: threading.Event | None = None  # for threads in wait()

    def done(self) -> bool:
        return self._done

    def raise_if_failed(self) -> None:
        """AuditUnavailable if the event is already known lost (its write failed); never waits."""
        if self._done and self._error is not None:
            raise self._error

    def wait(self, timeout: float | None = None) -> bool:
        """True once durable, False on timeout; raises AuditUnavailable if the write failed."""
        with self._lock:
            if not self._done and self._event is None:
                self._event = threading.Event()
            event = self._event
        if event is not None and not event.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True

    async def durable(self) -> None:
        with self._lock:
            if not self._done:
                loop = asyncio.get_running_loop()
                future: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, future))
            else:
                future = None  # type: ignore[assignment]
        if future is not None:
            await future
        if self._error is not None:
            raise self._error

    def __await__(self) -> Any:
        return self.durable().__await__()

    def _settle(self, seq: int | None, error: AuditUnavailable | None) -> list[tuple[Any, Any]]:
        """Resolve, waking waiting threads but not event loops; the loops' waiters to wake."""
        with self._lock:
            self.seq, self._error = seq, error
            self._done = True
            waiters, self._waiters = self._waiters, []
            event = self._event
        if event is not None:
            event.set()
        return waiters


def resolve_receipts(
    receipts: Sequence[Receipt], seqs: Sequence[int | None], error: AuditUnavailable | None
) -> None:
    """Resolve ``receipts`` (durable at ``seqs``, or failed with ``error``), waking each waiting loop once."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
    for receipt, seq in zip(receipts, seqs, strict=True):
        for loop, future in receipt._settle(seq, error):
            by_loop.setdefault(loop, []).append(future)
    for loop, futures in by_loop.items():
        try:
            loop.call_soon_threadsafe(_finish, futures)
        except RuntimeError:  # that loop is closed: nobody is waiting any more
            pass


def _finish(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)
