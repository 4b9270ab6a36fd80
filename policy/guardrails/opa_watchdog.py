"""The OPA pool and its watchdog: an embedded evaluation handed to a thread, and held to its time.

A tenant's embedded policy is evaluated on a small thread pool of its own, so a
slow policy never blocks the event loop. Its timeout counts the evaluating
thread's CPU time from when the thread takes the evaluation up: on a busy
two-core gateway a decision of under a millisecond of CPU waited tens of
milliseconds, once over 100, for the GIL and a core, and a wall-clock timeout
turned that wait into refusals (503). Time spent waiting is the gateway's load,
not the policy's cost, but it is bounded too: by ``QUEUE_SECONDS`` of wall time
for a thread (an evaluation that waited longer is not started), then by
``RUN_SECONDS`` once started.

rego-cpp cannot be interrupted: an evaluation past its time is answered as
timed out at once and left to end on its thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from inferflux.policy.guardrails.errors import OpaError

# Embedded evaluations run here, never on the event loop nor on the default pool that serves the store.
POOL_THREADS = 4
_POOL = ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="opa-eval")
QUEUE_SECONDS = 1.0  # longest an embedded evaluation may wait for a thread of _POOL
RUN_SECONDS = 1.0  # longest one may take in wall time once started (its CPU time is bounded by the policy's timeout)
WATCH_GRAIN = 0.001  # how often at most the loop looks at a running evaluation's clocks

T = TypeVar("T")


def thread_cpu_clock() -> Callable[[], float]:
    """The calling thread's CPU time in seconds, as a clock any thread can read while this one lives.

    Where the platform cannot read another thread's CPU time (macOS), the
    monotonic clock stands in: there the timeout counts wall time, as before.
    """
    if _CPU_CLOCK_ID is None:
        return time.monotonic
    cpu = _CPU_CLOCK_ID(threading.get_ident())  # the pool's threads live as long as the process
    return lambda: time.clock_gettime(cpu)


_CPU_CLOCK_ID = getattr(time, "pthread_getcpuclockid", None)  # absent on macOS


@dataclass(frozen=True)
class Started:
    """An evaluation a thread of the pool has taken up: when, and that thread's CPU clock with its reading then."""

    at: float  # time.monotonic()
    cpu: Callable[[], float]
    cpu_before: float

    def cpu_spent(self) -> float:
        """The evaluating thread's CPU time since it started; OSError once that thread is gone."""
        return self.cpu() - self.cpu_before


class Watchdog(Generic[T]):
    """One evaluation on the pool, and the loop's watch over its clocks until it is answered.

    One future, one timer and one wake-up of the loop per decision: this runs on
    every request, so no executor wrappers, shields or ``wait_for``. Built on the
    event loop; ``evaluate`` runs on a thread of the pool with the deadline
    (``time.monotonic()``) past which it must not start.
    """

    def __init__(self, evaluate: Callable[[float], T], timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.answer: asyncio.Future[T] = self.loop.create_future()
        self.timeout = timeout  # of the evaluating thread's CPU time
        self.queued = time.monotonic()
        self.wall = max(timeout, RUN_SECONDS)  # of wall time once started
        self.started: Started | None = None  # set by the evaluating thread as it begins
        self.job = _POOL.submit(self._run, evaluate)
        self.timer = self.loop.call_later(timeout, self._watch)

    async def result(self) -> T:
        """The evaluation's answer; TimeoutError past the policy's timeout, OpaError past a wall-time bound."""
        try:
            return await self.answer
        finally:
            self.timer.cancel()

    def _run(self, evaluate: Callable[[float], T]) -> None:
        """On the pool's thread: evaluate, then hand the result (or the error) to the loop."""
        cpu = thread_cpu_clock()
        cpu_before = cpu()
        started = self.started = Started(time.monotonic(), cpu, cpu_before)
        result: Any
        try:
            result = evaluate(self.queued + QUEUE_SECONDS)
            if started.cpu_spent() > self.timeout:  # ended between two looks of ``_watch``
                result = TimeoutError()
        except Exception as exc:  # handed to the awaiting task, which decides what it means
            result = exc
        try:
            self.loop.call_soon_threadsafe(_settle, self.answer, result)
        except RuntimeError:  # the loop is closed: nobody waits for this answer any more
            pass

    def _watch(self) -> None:
        """On the loop, from the policy's timeout on: fail the answer once a bound is passed, else look again."""
        if self.answer.done():
            return
        now = time.monotonic()
        started = self.started
        left, failure = self._queue_left(now) if started is None else self._run_left(started, now)
        if failure is not None:
            self.answer.set_exception(failure)
        else:
            self.timer = self.loop.call_later(max(left, WATCH_GRAIN), self._watch)

    def _queue_left(self, now: float) -> tuple[float, Exception | None]:
        """Not started yet: look again within one timeout (it may start meanwhile), until QUEUE_SECONDS."""
        left = min(self.timeout, self.queued + QUEUE_SECONDS - now)
        if left > 0:
            return left, None
        self.job.cancel()  # still queued: it will not start
        return 0.0, OpaError(f"no evaluator free within {QUEUE_SECONDS:.0f} s (the gateway is overloaded)")

    def _run_left(self, started: Started, now: float) -> tuple[float, Exception | None]:
        """Running: the CPU time left to it, and the wall time; the failure once either is spent."""
        try:
            left = self.timeout - started.cpu_spent()
        except OSError:  # its thread is gone (the pool shut down with the process): no answer comes
            left = 0
        if left <= 0:
            return 0.0, TimeoutError()
        if now - started.at >= self.wall:
            return 0.0, OpaError(f"no decision within {self.wall:.1f} s (the gateway is overloaded)")
        return min(left, started.at + self.wall - now), None


def _settle(answer: asyncio.Future[Any], result: Any) -> None:
    if answer.done():  # timed out, or the request went away
        return
    if isinstance(result, BaseException):
        answer.set_exception(result)
    else:
        answer.set_result(result)
