"""benchmarks/policy_paired.py: the request-by-request pairing, its interval and the chain threads' CPU,
on synthetic latencies (the gateway runs are the benchmark's, not a test's)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from scripts import load_benchmark

pp = load_benchmark("policy_paired")


def test_pairs_alternate_and_cancel_a_drift_the_rounds_would_see() -> None:
    # The host slows down by 1 ms a request: a block of base requests then a block of variant
    # requests would show the drift; pairs taken request by request show the true 0.5 ms.
    order: list[str] = []
    clock = iter(range(10_000))

    def request(name: str, cost: float) -> object:
        async def run() -> float:
            order.append(name)
            return next(clock) * 0.001 + cost

        return run

    result = asyncio.run(pp.paired_requests(request("base", 0.010), request("variant", 0.0105), 100))
    assert order[:4] == ["variant", "base", "base", "variant"]  # neither always first
    assert order.count("base") == order.count("variant") == 100
    # Half the pairs see the drift as +1 ms, half as -1 ms: the median lands on the true 0.5 ms.
    assert abs(result["added_p50_ms"] - 0.5) < 1e-9
    low, high = result["added_p50_ci95_ms"]
    assert low <= result["added_p50_ms"] <= high


def test_bootstrap_interval_brackets_the_median_and_narrows_with_more_values() -> None:
    import random

    rng = random.Random(1)
    few = [rng.gauss(1.0, 2.0) for _ in range(30)]
    many = [rng.gauss(1.0, 2.0) for _ in range(3000)]
    low_few, high_few = pp.bootstrap_median_ci(few)
    low_many, high_many = pp.bootstrap_median_ci(many)
    assert low_many < 1.0 < high_many
    assert high_many - low_many < (high_few - low_few) / 4


def test_thread_cpu_counts_only_the_threads_named() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    before_ids = pp.thread_ids()
    worker = threading.Thread(target=spin, name="audit-test-spinner", daemon=True)
    worker.start()
    try:
        started = pp.thread_ids() - before_ids
        before = pp.thread_cpu_seconds(started | {threading.get_ident()})
        time.sleep(0.3)
        spent = pp.cpu_spent(before, pp.thread_cpu_seconds(started))
    finally:
        stop.set()
        worker.join()
    assert started == {worker.ident}
    assert spent >= 0.05  # the spinner's CPU is counted; the main thread's is not (not read after)
    assert pp.thread_cpu_seconds(started) == {}  # an ended thread's clock is not read
    assert pp.cpu_spent(before, {}) == 0  # nor counted, up or down


def test_the_work_before_a_request_runs_each_time_and_is_not_timed() -> None:
    """``--sweep-mb``'s sweep runs before every request, outside its latency."""
    calls: list[str] = []
    clock = [0.0]  # a fake perf_counter: the sweep takes 10 s of it, the request 1 s

    async def send() -> None:
        calls.append("send")
        clock[0] += 1.0

    def before() -> None:
        calls.append("before")
        clock[0] += 10.0

    run = pp.timed(send, before)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pp.time, "perf_counter", lambda: clock[0])
        latencies = [asyncio.run(run()) for _ in range(3)]
    assert calls == ["before", "send"] * 3
    assert latencies == [1.0, 1.0, 1.0]
    assert pp.cache_sweeper(0) is None
    sweep = pp.cache_sweeper(1)
    assert sweep is not None and sweep() == (1 << 20) // 8  # a megabyte of float64 ones, read


def test_the_gap_spins_for_its_time_after_the_sweep() -> None:
    """``--gap-ms``: a spin of that long before each request, after the sweep when both are asked for."""
    assert pp.before_each(0, 0) is None
    start = time.perf_counter()
    pp.spin(0.02)
    assert time.perf_counter() - start >= 0.02
    calls: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pp, "cache_sweeper", lambda mb: (lambda: calls.append(f"sweep {mb}")) if mb else None)
        patch.setattr(pp, "spin", lambda seconds: calls.append(f"spin {seconds}"))
        both, gap_only = pp.before_each(3, 5.0), pp.before_each(0, 5.0)
        assert both is not None and gap_only is not None
        both()
        gap_only()
    assert calls == ["sweep 3", "spin 0.005", "spin 0.005"]
