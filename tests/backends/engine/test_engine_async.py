"""AsyncEngine: streaming, cancellation, failures, shutdown."""

import asyncio
import threading
import time

import pytest

from inferflux.backends.engine import (
    AsyncEngine,
    CacheCapacityError,
    DuplicateRequestError,
    EngineDeadError,
    EngineStepError,
    SamplingParams,
)

from engine_testkit import CharTokenizer, make_engine, reference_greedy

TIMEOUT = 20


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture
def aengine():
    engines = []

    def build(**kw):
        engine, backend = make_engine(**kw)
        a = AsyncEngine(engine)
        a.start()
        engines.append(a)
        return a, backend

    yield build
    for a in engines:
        a.shutdown(timeout=5)


async def collect(agen):
    outs = []
    async for out in agen:
        outs.append(out)
    return outs


async def wait_for(predicate, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


async def test_concurrent_streams_match_the_reference(aengine):
    a, backend = aengine(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=8)
    prompts = {f"r{i}": [i + 1, 2 * i + 3, 7] for i in range(6)}
    results = await asyncio.wait_for(
        asyncio.gather(*(collect(a.generate(rid, p, greedy(20))) for rid, p in prompts.items())), TIMEOUT
    )
    for (rid, p), outs in zip(prompts.items(), results):
        ref = reference_greedy(p, 20)
        assert [t for o in outs for t in o.new_token_ids] == ref
        assert "".join(o.new_text for o in outs) == CharTokenizer().decode(ref)
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert all(o.request_id == rid for o in outs)
    assert max(len(b.slices) for b in backend.batches) > 1  # they really shared steps
    await wait_for(lambda: a.stats().num_running == 0)
    assert a.stats().num_blocks_used == 0


async def test_generate_carries_the_tenant_to_the_scheduler(aengine):
    a, _ = aengine(num_blocks=64, max_num_seqs=2, delay=0.01)
    finished: list[str] = []

    async def run(rid: str, tenant: str, max_tokens: int) -> None:
        async for out in a.generate(rid, [3, 4, 5], greedy(max_tokens, ignore_eos=True), tenant=tenant, weight=2.0):
            if out.finished:
                finished.append(rid)

    long = [asyncio.ensure_future(run(f"a{i}", "a", 60)) for i in range(2)]
    await wait_for(lambda: a.stats().num_running == 2)
    queued = [asyncio.ensure_future(run(f"a{i}", "a", 2)) for i in range(2, 4)]
    await wait_for(lambda: a.stats().num_waiting == 2)
    await asyncio.wait_for(asyncio.gather(run("b", "b", 2), *long, *queued), TIMEOUT)
    # a held both seats: b took one at once and ended first (FIFO: after a2 and a3 at best)
    assert finished[0] == "b" and sorted(finished) == ["a0", "a1", "a2", "a3", "b"]
    assert a.stats().num_preemptions == 1


async def test_consumer_closing_the_stream_aborts_and_frees_blocks(aengine):
    a, _ = aengine(delay=0.002)
    agen = a.generate("long", [1, 2, 3], greedy(800, ignore_eos=True))
    seen = 0
    async for _ in agen:
        seen += 1
        if seen == 3:
            break
    await agen.aclose()
    await wait_for(lambda: a.stats().num_running == 0 and a.stats().num_blocks_used == 0)
    assert a.stats().num_tokens_generated < 800
    # the id is free again
    outs = await asyncio.wait_for(collect(a.generate("long", [1, 2, 3], greedy(3))), TIMEOUT)
    assert outs[-1].finished


async def test_cancelling_the_consuming_task_aborts_the_request(aengine):
    a, _ = aengine(delay=0.002)
    started = asyncio.Event()

    async def consume():
        async for _ in a.generate("c", [4, 5], greedy(800, ignore_eos=True)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), TIMEOUT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: a.stats().num_running + a.stats().num_waiting == 0 and a.stats().num_blocks_used == 0)


async def test_abort_ends_the_stream_with_abort(aengine):
    a, _ = aengine(delay=0.002)
    outs = []

    async def consume():
        async for out in a.generate("x", [1], greedy(800, ignore_eos=True)):
            outs.append(out)
            if len(outs) == 2:
                a.abort("x")

    await asyncio.wait_for(consume(), TIMEOUT)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    a.abort("unknown")  # harmless


async def test_invalid_requests_raise_in_generate(aengine):
    a, _ = aengine(num_blocks=4, block_size=4)
    with pytest.raises(CacheCapacityError):
        await collect(a.generate("big", [1] * 10, greedy(10)))

    gate = asyncio.Event()

    async def hold():
        async for _ in a.generate("dup", [1], greedy(10, ignore_eos=True)):
            await gate.wait()

    task = asyncio.create_task(hold())
    await asyncio.sleep(0.05)
    with pytest.raises(DuplicateRequestError):
        await collect(a.generate("dup", [1], greedy(2)))
    gate.set()
    await asyncio.wait_for(task, TIMEOUT)


async def test_step_failure_fails_in_flight_requests_then_serves_new_ones(aengine):
    a, backend = aengine(delay=0.002)
    first = asyncio.Event()

    async def victim(rid):
        async for _ in a.generate(rid, [1, 2], greedy(500, ignore_eos=True)):
            first.set()

    tasks = [asyncio.create_task(victim(f"v{i}")) for i in range(3)]
    await asyncio.wait_for(first.wait(), TIMEOUT)
    backend.fail_next = 1
    for t in tasks:
        with pytest.raises(EngineStepError) as info:
            await asyncio.wait_for(t, TIMEOUT)
        assert isinstance(info.value.__cause__, RuntimeError)
    await wait_for(lambda: a.stats().num_blocks_used == 0)
    outs = await asyncio.wait_for(collect(a.generate("after", [3, 4], greedy(5))), TIMEOUT)
    assert outs[-1].finished and [t for o in outs for t in o.new_token_ids] == reference_greedy([3, 4], 5)


def engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "inferflux-engine" and t.is_alive()}


async def test_shutdown_joins_and_fails_requests(aengine):
    others = engine_threads()  # engines of other tests in this process (a session's served model)
    a, _ = aengine(delay=0.002)
    got_one = asyncio.Event()

    async def consume():
        async for _ in a.generate("s", [1], greedy(800, ignore_eos=True)):
            got_one.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_one.wait(), TIMEOUT)
    await asyncio.to_thread(a.shutdown, 5)
    assert not a.is_running
    assert engine_threads() <= others
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(task, TIMEOUT)
    with pytest.raises(EngineDeadError):
        await collect(a.generate("late", [1], greedy(2)))


async def test_idle_loop_sleeps():
    engine, backend = make_engine()
    a = AsyncEngine(engine)
    a.start()
    try:
        await collect(a.generate("one", [1, 2], greedy(3)))
        steps = a.stats().num_steps
        assert steps == len(backend.batches)  # stats are published before the last output
        cpu0 = time.process_time()  # all threads of this process
        await asyncio.sleep(0.3)
        assert time.process_time() - cpu0 < 0.1  # the engine thread is asleep, not spinning
        assert a.stats().num_steps == steps == len(backend.batches)
    finally:
        a.shutdown(5)


def test_start_lets_the_backend_release_the_loading_threads_resources():
    # The hook runs on the starting (loading) thread, before the engine thread exists.
    engine, backend = make_engine(num_blocks=8)
    calls = []
    backend.release_thread_pool = lambda: calls.append(threading.current_thread())
    a = AsyncEngine(engine)
    a.start()
    a.start()  # idempotent: not released twice
    try:
        assert calls == [threading.current_thread()]
    finally:
        a.shutdown(timeout=5)


async def test_last_output_carries_the_request_timings_in_order(aengine):
    """Queue wait, prefill and decode (the gateway's trace stages) come from these: each moment at or
    after the one before, arrival no earlier than the hand-over, and only the last output has them."""
    a, _ = aengine()
    handed = time.perf_counter()
    outputs = await collect(a.generate("timed", [1, 2, 3, 4, 5], greedy(6, ignore_eos=True)))
    got = time.perf_counter()
    assert all(out.timings is None for out in outputs[:-1])
    t = outputs[-1].timings
    assert t is not None
    assert handed <= t.arrived <= t.admitted <= t.first_token <= t.finished <= got
    assert t.finished > t.first_token  # six tokens: decoding took some steps
