"""The stand-in device: deterministic logits, the step time it waits, the engine thread's CPU,
and that nothing starts it by accident."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import numpy as np
import pytest

from inferflux.backends import registry
from inferflux.backends.base import Batch, BackendError, ModelSpec, SequenceSlice
from inferflux.backends.models import default_model_path
from inferflux.backends.standin import STEP_ENV, StandinBackend, StepTime

BLOCK = 16


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandinBackend]:
    monkeypatch.setenv(STEP_ENV, "0,0")  # no wait: these tests look at the logits
    backend = StandinBackend()
    backend.load(ModelSpec(name="standin", path=default_model_path()))
    backend.allocate_kv(32, BLOCK)
    yield backend


def batch() -> Batch:
    """A decode row, a prefill chunk that asks for no logits, a prompt's end and a three-row verification."""
    return Batch([
        SequenceSlice(0, [431], 7, [0]),
        SequenceSlice(1, [5, 6, 7, 8], 0, [1], num_logits=0),
        SequenceSlice(2, [900, 901, 902], 0, [2]),
        SequenceSlice(3, [12, 13, 14], 20, [3, 4], num_logits=3),
    ], BLOCK)  # fmt: skip


def test_the_logits_are_a_function_of_the_input_ids_alone(standin: StandinBackend) -> None:
    logits = standin.forward(batch())
    assert logits.shape == (5, standin.info.vocab_size) and logits.dtype == np.float32
    other = StandinBackend()  # a second instance, loaded afresh: the same bits
    other.load(ModelSpec(name="again", path=default_model_path()))
    other.allocate_kv(32, BLOCK)
    np.testing.assert_array_equal(other.forward(batch()), logits)
    # Each row: a top logit on an ordinary token, a runner-up below it, zeros elsewhere.
    top = logits.argmax(axis=1)
    assert (logits.max(axis=1) == 20.0).all() and np.isin(top, standin._ordinary).all()
    assert ((logits > 0).sum(axis=1) <= 2).all()
    # A row depends on its token and position, not on what else is in the batch.
    alone = standin.forward(Batch([SequenceSlice(9, [12, 13, 14], 20, [0, 1], num_logits=3)], BLOCK))
    np.testing.assert_array_equal(alone, logits[2:])
    moved = standin.forward(Batch([SequenceSlice(0, [431], 8, [0])], BLOCK))
    assert moved.argmax() != top[0]  # the same token one position on picks another


def test_greedy_decoding_is_a_stream_of_printable_text(standin: StandinBackend) -> None:
    from inferflux.backends.models import open_model

    tokenizer = open_model(default_model_path()).tokenizer()
    ids = tokenizer.encode("Once upon a time")
    start = len(ids)
    for _ in range(16):
        row = standin.forward(Batch([SequenceSlice(0, ids[-1:], len(ids) - 1, [0, 1])], BLOCK))
        ids.append(int(row.argmax()))
    text = tokenizer.decode(ids[start:])
    assert len(text) >= 16 and text.isascii() and text.isprintable(), text


def test_each_step_waits_at_least_the_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STEP_ENV, "3,0.5")
    backend = StandinBackend()
    backend.load(ModelSpec(name="standin", path=default_model_path()))
    backend.allocate_kv(32, BLOCK)
    rows = [SequenceSlice(i, [100 + i], 4, [i]) for i in range(8)]
    steps = 10
    started = time.perf_counter()
    for _ in range(steps):
        backend.forward(Batch(rows, BLOCK))
    elapsed = time.perf_counter() - started
    # A lower bound only: a loaded machine may take longer, never shorter.
    assert elapsed >= steps * (0.003 + 0.0005 * 8), elapsed


@pytest.mark.parametrize("text", ["", "1.4", "1.4,0.04,2", "a,b", "-1,0", "nan,0", "1,inf", "20000,0"])
def test_a_step_time_it_cannot_use_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=STEP_ENV):
        StepTime.parse(text)


def test_the_step_time_is_milliseconds_base_and_per_row() -> None:
    step = StepTime.parse(" 1.4 , 0.04 ")
    assert step.seconds(32) == pytest.approx(0.0014 + 0.00004 * 32)


def test_nothing_starts_it_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STEP_ENV, raising=False)
    status = registry.probe("standin")
    assert not status.available and STEP_ENV in str(status.reason)
    with pytest.raises(BackendError, match=STEP_ENV):
        registry.resolve("standin")
    with pytest.raises(BackendError, match=STEP_ENV):
        StandinBackend()
    monkeypatch.setenv(STEP_ENV, "1.4,0.04")
    assert registry.resolve("standin")[0] == "standin"
    assert "standin" not in registry.default_priority("Linux") + registry.default_priority("Darwin")
    assert registry.resolve(registry.AUTO)[0] != "standin"  # set or not, auto never picks it
    with pytest.raises(BackendError, match="not allowed"):  # and the allow-list keeps it out like any plugin
        registry.resolve("standin", allowed=["cpu"])


def test_what_it_cannot_do_is_a_backend_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STEP_ENV, "0,0")
    backend = StandinBackend()
    with pytest.raises(BackendError, match="before load"):
        backend.forward(batch())
    with pytest.raises(BackendError, match="deterministic"):
        backend.load(ModelSpec(name="standin", path=default_model_path(), deterministic=True))
    with pytest.raises(BackendError, match="cannot load"):
        backend.load(ModelSpec(name="standin", path="/no/such/model.gguf"))
    backend.load(ModelSpec(name="standin", path=default_model_path()))
    backend.allocate_kv(4, BLOCK)
    with pytest.raises(BackendError, match="block size"):
        backend.forward(Batch([SequenceSlice(0, [1], 0, [0])], 8))
    with pytest.raises(BackendError, match="outside"):
        backend.copy_blocks([(0, 4)])


def test_the_engine_thread_cpu_leaves_the_device_wait_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine thread's CPU counter moves with its steps, and the stand-in's 50 ms waits (which
    release the GIL, as a GPU's synchronising wait does) are not in it."""
    from inferflux.backends.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
    from inferflux.backends.models import open_model

    monkeypatch.setenv(STEP_ENV, "50,0")
    backend = StandinBackend()
    info = backend.load(ModelSpec(name="standin", path=default_model_path()))
    tokenizer = open_model(default_model_path()).tokenizer()
    engine = AsyncEngine(LLMEngine(backend, tokenizer, info, EngineConfig(num_blocks=16)))
    engine.start()
    try:
        before = engine.stats()

        async def run() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=6)
            async for _ in engine.generate("r1", tokenizer.encode("Hello"), params):
                pass

        asyncio.run(run())
        after = engine.stats()
    finally:
        engine.shutdown(timeout=5)
    steps = after.num_steps - before.num_steps
    cpu = after.engine_thread_cpu_seconds - before.engine_thread_cpu_seconds
    assert steps >= 6 and cpu > 0
    assert cpu < steps * 0.050, (cpu, steps)  # the waits alone would be steps * 50 ms
