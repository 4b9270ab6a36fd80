"""Embeddings in the engine: requests checked once, batched under the step budget, run on the
engine thread between generation steps without touching running sequences, finished
(cut to ``dimensions``, L2-normalised) in numpy.

The backend is the paged echo backend with an ``embed`` whose vectors are a plain function
of each input's tokens, so the batching, the order of the rows and the finishing can be
checked exactly; the real models' embeddings are checked against transformers in
tests/backends/conformance/test_conformance_embeddings.py.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from inferflux.backends.engine import (
    AsyncEngine,
    EmbeddingsUnsupportedError,
    EngineDeadError,
    EngineStepError,
    InputTooLongError,
    InvalidRequestError,
    LLMEngine,
    SamplingParams,
)
from inferflux.backends.engine.embedding import finish

from engine_testkit import CharTokenizer, PagedEchoBackend, model_info, reference_greedy

TIMEOUT = 20
BUDGET = 16  # max_num_batched_tokens: the most tokens one embedding batch may hold (one input may exceed it)


def vector(tokens: list[int] | tuple[int, ...], pooling: str) -> np.ndarray:
    """What ``EmbeddingEchoBackend`` pools for ``tokens``: a function of the tokens and their order."""
    arr = np.asarray(tokens, dtype=np.float32)
    if pooling == "last":
        return np.array([arr[-1], len(arr), 1.0, -2.0], dtype=np.float32)
    return np.array([arr.mean(), len(arr), (arr * np.arange(1, len(arr) + 1)).sum() / len(arr), 3.0], dtype=np.float32)


class EmbeddingEchoBackend(PagedEchoBackend):
    """The echo backend with ``embed``: every call is recorded, in order with the forward steps."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.calls: list[tuple[str, int]] = []  # ("forward" | "embed", tokens), in call order
        self.fail_embed = 0
        # ``hold`` makes the embed call of that number (0: the first) wait for ``release``; ``held`` tells it is waiting.
        self.hold: int | None = None
        self.held, self.release = threading.Event(), threading.Event()
        self.embed_calls = 0

    def forward(self, batch: Any) -> np.ndarray:
        self.calls.append(("forward", batch.num_tokens))
        return super().forward(batch)

    def embed(self, token_lists: Any, pooling: str) -> np.ndarray:
        call, self.embed_calls = self.embed_calls, self.embed_calls + 1
        if call == self.hold:
            self.held.set()
            self.release.wait(TIMEOUT)
        if self.fail_embed:
            self.fail_embed -= 1
            raise RuntimeError("injected embed failure")
        self.calls.append(("embed", sum(len(t) for t in token_lists)))
        return np.stack([vector(t, pooling) for t in token_lists])


def make(backend: PagedEchoBackend | None = None, **config: Any) -> tuple[LLMEngine, Any]:
    from inferflux.backends.engine import EngineConfig

    backend = backend or EmbeddingEchoBackend()
    info = model_info(context_length=64)
    engine = LLMEngine(backend, CharTokenizer(), info, EngineConfig(block_size=4, num_blocks=64,
                                                                   max_num_batched_tokens=BUDGET, **config))
    return engine, backend


def inputs(*sizes: int) -> list[list[int]]:
    rng = np.random.default_rng(sum(sizes))
    return [rng.integers(1, 200, n).tolist() for n in sizes]


# -- checking --------------------------------------------------------------------------------


def test_a_request_is_checked_once_naming_the_input() -> None:
    engine, _ = make()
    request = engine.make_embedding_request("e", [[1, 2], (3,)], "mean", dimensions=2, tenant="t")
    assert request.inputs == ((1, 2), (3,)) and request.num_tokens == 3 and request.tenant == "t"
    cases: list[tuple[Any, dict[str, Any], str]] = [
        ([[1], []], {}, "input[1]"),
        ([[1], [256]], {}, "input[1]"),  # outside the vocabulary of 256
        ([[-1]], {}, "input[0]"),
        ([[1.5]], {}, "input[0]"),
        ([], {}, "input"),
        ([[1]], {"dimensions": 0}, "dimensions"),
        ([[1]], {"dimensions": True}, "dimensions"),
        ([[1]], {"pooling": "cls"}, "pooling"),
    ]
    for given, kwargs, param in cases:
        pooling = kwargs.pop("pooling", "mean")
        with pytest.raises(InvalidRequestError) as info:
            engine.make_embedding_request("e", given, pooling, **kwargs)
        assert info.value.param == param, (given, kwargs)
    # As long as the context is fine (no room for output is needed); one more token is not.
    assert engine.make_embedding_request("e", [[1] * 64], "last").num_tokens == 64
    with pytest.raises(InputTooLongError) as info:
        engine.make_embedding_request("e", [[1], [1] * 65], "last")
    assert info.value.param == "input[1]" and "64" in str(info.value) and "65" in str(info.value)


def test_a_backend_without_embed_is_refused_with_a_reason() -> None:
    engine, _ = make(PagedEchoBackend())
    assert not engine.supports_embeddings
    with pytest.raises(EmbeddingsUnsupportedError) as info:
        engine.make_embedding_request("e", [[1]], "mean")
    assert info.value.param == "model" and "paged-echo backend" in str(info.value)


# -- batching and finishing ------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_batches_stay_within_the_step_budget_and_rows_keep_their_order(pooling: str) -> None:
    engine, backend = make()
    given = inputs(5, 7, 3, 20, 1, 16, 2, 9)
    result = engine.embed_request(engine.make_embedding_request("e", given, pooling, normalize=False))
    sizes = [tokens for kind, tokens in backend.calls]
    # In order, as many whole inputs as fit in 16 tokens: 5+7+3; 20 alone (longer than the budget); 1; 16; 2+9.
    assert sizes == [15, 20, 1, 16, 11]
    assert all(kind == "embed" for kind, _ in backend.calls)
    np.testing.assert_array_equal(result.vectors, np.stack([vector(t, pooling) for t in given]))
    assert result.prompt_tokens == sum(len(t) for t in given) == engine.stats().num_tokens_embedded


def test_vectors_are_cut_to_dimensions_then_normalised() -> None:
    engine, _ = make()
    given = inputs(3, 4)
    whole = engine.embed_request(engine.make_embedding_request("a", given, "mean")).vectors
    raw = np.stack([vector(t, "mean") for t in given])
    np.testing.assert_allclose(whole, raw / np.linalg.norm(raw, axis=1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(whole, axis=1), 1.0, rtol=1e-6)
    cut = engine.embed_request(engine.make_embedding_request("b", given, "mean", dimensions=2)).vectors
    assert cut.shape == (2, 2) and cut.dtype == np.float32
    np.testing.assert_allclose(cut, raw[:, :2] / np.linalg.norm(raw[:, :2], axis=1, keepdims=True), rtol=1e-6)


def test_a_zero_vector_is_returned_as_it_is() -> None:
    out = finish(np.array([[0.0, 0.0], [3.0, 4.0]]), None, True)
    np.testing.assert_array_equal(out, np.array([[0.0, 0.0], [0.6, 0.8]], dtype=np.float32))
    assert not np.isnan(out).any()


# -- on the engine thread, beside generation ---------------------------------------------------


@pytest.fixture
def running() -> Any:
    started: list[AsyncEngine] = []

    def build(**config: Any) -> tuple[AsyncEngine, EmbeddingEchoBackend]:
        engine, backend = make(**config)
        a = AsyncEngine(engine)
        a.start()
        started.append(a)
        return a, backend

    yield build
    for a in started:
        a.shutdown(timeout=5)


async def collect_tokens(a: AsyncEngine, rid: str, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [t async for out in a.generate(rid, prompt, params) for t in out.new_token_ids]


async def test_embedding_batches_take_turns_with_generation_steps(running: Any) -> None:
    a, backend = running()
    request = a.make_embedding_request("e", inputs(*[8] * 64), "mean")  # 64 inputs: 32 batches of 16 tokens
    generated, result = await asyncio.wait_for(
        asyncio.gather(collect_tokens(a, "g", [1, 2, 3], 40), a.embed(request)), TIMEOUT
    )
    # The generation is the one it would be alone: embedding never touched its KV.
    assert generated == reference_greedy([1, 2, 3], 40)
    assert result.vectors.shape == (64, 4) and result.prompt_tokens == 512
    kinds = [kind for kind, _ in backend.calls]
    # While both had work, neither waited for the other to finish: their calls alternate.
    first_embed, last_embed = kinds.index("embed"), len(kinds) - 1 - kinds[::-1].index("embed")
    between = kinds[first_embed : last_embed + 1]
    assert between.count("embed") == 32 and between.count("forward") >= 20
    assert all(x != y for x, y in zip(between, between[1:])), between


async def test_requests_of_several_callers_share_batches_in_arrival_order(running: Any) -> None:
    a, backend = running()
    backend.hold = 0  # the first batch waits, so that all three requests are queued behind it
    first = a.make_embedding_request("a", inputs(10, 10), "mean")
    others = [a.make_embedding_request(rid, inputs(3), "mean", tenant="t") for rid in ("b", "c")]
    tasks = [asyncio.create_task(a.embed(r)) for r in (first, *others)]
    assert await asyncio.to_thread(backend.held.wait, TIMEOUT)
    backend.release.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
    # a's second input (10) shares its batch with b's and c's (3 + 3): 10 | 10 + 3 + 3.
    assert [tokens for _, tokens in backend.calls] == [10, 16]
    assert [r.vectors.shape[0] for r in results] == [2, 1, 1]
    np.testing.assert_array_equal(results[1].vectors[0], finish(vector(others[0].inputs[0], "mean")[None], None, True)[0])


async def test_stats_count_the_waiting_embedding_requests(running: Any) -> None:
    a, backend = running()
    backend.hold = 1  # the second of the request's two batches waits
    task = asyncio.create_task(a.embed(a.make_embedding_request("e", inputs(16, 16), "mean", tenant="t")))
    assert await asyncio.to_thread(backend.held.wait, TIMEOUT)
    stats = a.stats()  # published after the first batch
    assert (stats.num_waiting_embeddings, stats.embeddings_waiting_per_tenant) == (1, {"t": 1})
    backend.release.set()
    await asyncio.wait_for(task, TIMEOUT)
    stats = a.stats()
    assert (stats.num_waiting_embeddings, stats.embeddings_waiting_per_tenant, stats.num_tokens_embedded) == (0, {}, 32)


async def test_a_caller_that_leaves_drops_the_rest_of_its_request(running: Any) -> None:
    a, backend = running()
    backend.hold = 0
    task = asyncio.create_task(a.embed(a.make_embedding_request("e", inputs(*[16] * 10), "last")))
    assert await asyncio.to_thread(backend.held.wait, TIMEOUT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    backend.release.set()
    # The engine carries on with other work; the left request's other nine batches never run.
    assert await asyncio.wait_for(collect_tokens(a, "g", [5, 6], 3), TIMEOUT) == reference_greedy([5, 6], 3)
    assert [kind for kind, _ in backend.calls].count("embed") == 1
    assert a.stats().num_waiting_embeddings == 0


async def test_a_failed_batch_fails_its_requests_only(running: Any) -> None:
    a, backend = running()
    backend.fail_embed = 1
    with pytest.raises(EngineStepError) as info:
        await asyncio.wait_for(a.embed(a.make_embedding_request("e", inputs(4), "mean")), TIMEOUT)
    assert isinstance(info.value.__cause__, RuntimeError)
    again = await asyncio.wait_for(a.embed(a.make_embedding_request("f", inputs(4), "mean")), TIMEOUT)
    assert again.vectors.shape == (1, 4)
    assert await asyncio.wait_for(collect_tokens(a, "g", [5, 6], 5), TIMEOUT) == reference_greedy([5, 6], 5)


async def test_shutdown_fails_waiting_embeddings(running: Any) -> None:
    a, backend = running()
    backend.hold = 0
    task = asyncio.create_task(a.embed(a.make_embedding_request("e", inputs(*[16] * 4), "mean")))
    assert await asyncio.to_thread(backend.held.wait, TIMEOUT)
    stopping = asyncio.create_task(asyncio.to_thread(a.shutdown, 5))
    await asyncio.sleep(0.05)
    backend.release.set()
    await stopping
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(task, TIMEOUT)
    with pytest.raises(EngineDeadError):
        await a.embed(a.make_embedding_request("late", inputs(2), "mean"))
