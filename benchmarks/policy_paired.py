"""bench_policy's paired phase: the chain's end-to-end cost, request by request, and its work off the request path.

Why a second design beside the rounds: a real generation's latency varies from request to
request by several milliseconds (the engine's threads, the shared host), so the rounds' paired
medians (``on`` minus ``off`` over a block of requests each) spread by more than the chain
costs; twenty of them leave the end-to-end figure uncertain by about a millisecond either way.
Here the two variants alternate *request by request* (``off``, ``on``, then ``on``, ``off``, so
neither always goes first) and each pair's difference is taken: the drift of the host cancels
within a pair, and the median of a few hundred pairs is known to a tenth of a millisecond
(a bootstrap interval says how well).

What this design cannot see is work the chain defers to other threads (the audit trail's
store indexer, fsync and housekeeping threads): it runs during whichever request
comes next, ``off``'s as often as ``on``'s. So the same phase also reads the CPU time of the
audit threads the ``on`` app started (their CPU-time clocks; bench_policy passes them) and reports it per ``on`` request, to be
added to the paired figure for a bound on everything the chain costs. (It is a bound: those
threads also tick while idle, a cost per second rather than per request.)
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any


def thread_ids() -> set[int]:
    """The idents of this process's Python threads now (take them before and after an app starts:
    the difference is the threads it started)."""
    return {t.ident for t in threading.enumerate() if t.ident is not None}


def thread_cpu_seconds(ids: Collection[int]) -> dict[int, float]:
    """CPU seconds used so far by each of the threads ``ids`` still running (their CPU-time clocks:
    nanoseconds, where ``/proc``'s counters tick every 10 ms); an ended thread is left out."""
    alive = thread_ids()
    # A clock of an ended thread must not be read.
    return {i: time.clock_gettime(time.pthread_getcpuclockid(i)) for i in ids if i in alive}


def cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the threads running at both readings spent between them."""
    return sum(after[i] - before[i] for i in before.keys() & after.keys())


def bootstrap_median_ci(values: Sequence[float], *, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval for the median of ``values``."""
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


async def paired_requests(
    base: Callable[[], Awaitable[float]], variant: Callable[[], Awaitable[float]], pairs: int,
    variant_threads: Collection[int] = (),
) -> dict[str, Any]:
    """``pairs`` pairs of one ``base`` and one ``variant`` request (each a coroutine giving its latency in
    seconds), alternating which goes first; the median of variant minus base and its interval, in ms,
    and the CPU of ``variant_threads`` (the threads the variant's app started) per variant request."""
    differences: list[float] = []
    cpu_before = thread_cpu_seconds(variant_threads)
    for i in range(pairs):
        if i % 2:
            b, v = await base(), await variant()
        else:
            v, b = await variant(), await base()
        differences.append(v - b)
    background = cpu_spent(cpu_before, thread_cpu_seconds(variant_threads))
    low, high = bootstrap_median_ci(differences)
    return {
        "pairs": pairs,
        "added_p50_ms": statistics.median(differences) * 1000,
        "added_p50_ci95_ms": [low * 1000, high * 1000],
        "chain_threads_cpu_ms_per_request": background / pairs * 1000,
    }


def timed(send: Callable[[], Awaitable[object]],
          before: Callable[[], object] | None = None) -> Callable[[], Awaitable[float]]:
    """``send`` as a coroutine that gives its latency in seconds; ``before`` runs first, untimed."""

    async def run() -> float:
        if before is not None:
            before()
        start = time.perf_counter()
        await send()
        return time.perf_counter() - start

    return run


def spin(seconds: float) -> None:
    """Keep this thread busy for ``seconds``: the GIL held, nothing read but the clock. Time passing
    between two requests without a forward's memory traffic, syscalls or an idle CPU; on the shared
    hosts measured, the next request's Python still ran about twice as slowly after 10 ms of it as
    back to back (``--gap-ms``; docs/benchmarks.md)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def before_each(sweep_mb: int, gap_ms: float) -> Callable[[], object] | None:
    """What runs, untimed, before each paired request: a cache sweep, a spin, both or nothing."""
    sweep = cache_sweeper(sweep_mb)
    if gap_ms <= 0:
        return sweep
    gap = gap_ms / 1000

    def run() -> None:
        if sweep is not None:
            sweep()
        spin(gap)

    return run


def cache_sweeper(megabytes: int) -> Callable[[], object] | None:
    """A call that reads ``megabytes`` of memory (None for 0): what a real generation's weights do to
    the CPU's caches between two requests, for the stand-in engine, whose requests otherwise find the
    chain's code and data still cached (``--sweep-mb``: the chain costs about twice as much cold)."""
    if megabytes <= 0:
        return None
    import numpy as np

    block = np.ones(megabytes * (1 << 20) // 8)
    return block.sum
