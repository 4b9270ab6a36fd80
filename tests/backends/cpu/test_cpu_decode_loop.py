"""The C++ loop over layers for decode steps (backends/cpu/decode_loop.py, kernels/cpu/decode_loop.cpp).

Greedy decoding through the loop gives the Python path's logits bit for bit (same kernels,
same order), and only the steps it applies to go through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from inferflux.backends.base import Batch, ModelSpec, SequenceSlice
from inferflux.backends.cpu import CPUBackend
from inferflux.backends.models import default_model_path
from inferflux.kernels import cpu as cpu_kernels
from shaped_models import tiny_q4_k_m

pytestmark = [pytest.mark.slow, pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ CPU kernels")]
BS = 16
BLOCKS_PER_SEQ = 5  # the longest prompt (17 + 5 * 9 tokens) and its steps fit
STEPS = 10


def _load(mode: str, dtype: str = "bfloat16", **extra: Any) -> CPUBackend:
    """``mode``: a quantise mode, or ``mode@n`` for one with ``gemm_from: n``."""
    mode, _, gemm_from = mode.partition("@")
    config: dict[str, Any] = {"quantise": mode, **({"gemm_from": int(gemm_from)} if gemm_from else {})}
    backend = CPUBackend()
    backend.load(ModelSpec(name="m", path=default_model_path(), dtype=dtype, passes=config, **extra))
    backend.allocate_kv(10 * BLOCKS_PER_SEQ, BS)  # up to 10 sequences
    return backend


@pytest.fixture(scope="module")
def hybrid() -> CPUBackend:
    return _load("hybrid")


@pytest.fixture(scope="module")
def native() -> CPUBackend:
    return _load("native")


def _table(seq: int) -> list[int]:
    return list(range(seq * BLOCKS_PER_SEQ, (seq + 1) * BLOCKS_PER_SEQ))


def _count_loop_calls(backend: CPUBackend) -> list[int]:
    """A counter of the loop's steps (the loop's run, wrapped)."""
    loop = backend.model.decode_loop
    calls = [0]
    run: Callable[..., Any] = loop.run

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return run(*args, **kwargs)

    loop.run = counted  # type: ignore[method-assign]
    return calls


def _greedy(backend: CPUBackend, rows: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill ``rows`` prompts of different lengths, then STEPS greedy decode steps of all of them."""
    for k, v in backend.kv_caches:  # a fresh cache: nothing left from the other path's run
        k.zero_()
        v.zero_()
    prompts = [[(7 * i + 3 + 11 * r) % 1000 + 10 for i in range(17 + 5 * r)] for r in range(rows)]
    logits = backend.forward(Batch([SequenceSlice(r, p, 0, _table(r)) for r, p in enumerate(prompts)], BS))
    last = logits.argmax(-1).tolist()
    pos = [len(p) for p in prompts]
    steps, tokens = [], []
    for _ in range(STEPS):
        logits = backend.forward(Batch([SequenceSlice(r, [last[r]], pos[r], _table(r)) for r in range(rows)], BS))
        steps.append(logits.clone())
        last = logits.argmax(-1).tolist()
        tokens.append(last)
        pos = [p + 1 for p in pos]
    return steps, tokens


needs_exact32 = pytest.mark.skipif(not cpu_kernels.exact_linear_supported(torch.float32),
                                   reason="exact_linear on float32 rows needs AVX-512F, which this CPU lacks")


@pytest.mark.parametrize("mode,dtype,rows", [
    ("hybrid", "bfloat16", 1), ("native", "bfloat16", 3), ("native", "float32", 2), ("auto", "bfloat16", 1),
    ("auto", "bfloat16", 8), ("auto", "bfloat16", 10), ("bf16", "bfloat16", 8), ("f32", "float32", 2),
    # float32 exact (auto there, with AVX-512F): the blocks' side, and with gemm_from 9 the dense side too.
    pytest.param("auto", "float32", 1, marks=needs_exact32), pytest.param("exact", "float32", 8, marks=needs_exact32),
    pytest.param("exact@9", "float32", 10, marks=needs_exact32),
])  # fmt: skip
def test_greedy_decoding_through_the_loop_gives_the_python_paths_bits(mode: str, dtype: str, rows: int) -> None:
    backend = _load(mode, dtype)
    loop = backend.model.decode_loop
    assert loop is not None and loop.max_rows >= rows
    calls = _count_loop_calls(backend)
    via_loop, loop_tokens = _greedy(backend, rows)
    assert calls[0] == STEPS  # every decode step went through the loop, the prefill did not
    backend.model.decode_loop = None
    via_python, python_tokens = _greedy(backend, rows)
    backend.model.decode_loop = loop
    assert calls[0] == STEPS
    assert loop_tokens == python_tokens
    for a, b in zip(via_loop, via_python):
        assert a.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_q4_k_m_model_in_blocks_runs_the_loop_with_the_python_paths_bits(tmp_path: Path, rows: int) -> None:
    """The K types in the loop: Q4_K and Q6_K projections, and layer 1's q/k/v stacked from Q4_K and Q6_K blocks,
    each part by exact_linear into its columns."""
    from inferflux.backends.cpu.linear import StackedQuantLinear

    backend = CPUBackend()
    info = backend.load(ModelSpec(name="k", path=str(tiny_q4_k_m(tmp_path)), dtype="float32",
                                  passes={"quantise": "blocks"}))
    assert next(r for r in info.passes if r["name"] == "decode_loop")["status"] == "ran"
    assert isinstance(backend.model.layers[1].attn.qkv, StackedQuantLinear)
    backend.allocate_kv(10 * BLOCKS_PER_SEQ, BS)
    loop = backend.model.decode_loop
    calls = _count_loop_calls(backend)
    via_loop, loop_tokens = _greedy(backend, rows)
    assert calls[0] == STEPS
    backend.model.decode_loop = None
    via_python, python_tokens = _greedy(backend, rows)
    backend.model.decode_loop = loop
    assert loop_tokens == python_tokens
    for a, b in zip(via_loop, via_python):
        assert torch.equal(a, b)


def _decode(seq: int, pos: int) -> SequenceSlice:
    return SequenceSlice(seq, [100 + seq], pos, _table(seq))


def _prefilled(backend: CPUBackend, seqs: int, length: int = 20) -> None:
    backend.forward(Batch([SequenceSlice(s, list(range(10, 10 + length)), 0, _table(s)) for s in range(seqs)], BS))


@pytest.mark.parametrize("batch,runs", [
    ([_decode(0, 20)], True),  # one decode row
    ([_decode(s, 20) for s in range(8)], True),  # native: decode rows below gemm_from (32)
    ([SequenceSlice(0, list(range(10, 18)), 0, _table(0))], False),  # a prefill
    ([_decode(0, 20), SequenceSlice(1, list(range(10, 14)), 20, _table(1))], False),  # a decode beside a chunk
    ([SequenceSlice(0, [5, 6, 7], 20, _table(0))], False),  # a draft of three tokens being verified
])
def test_native_runs_the_loop_only_for_single_token_rows(native: CPUBackend, batch: list[SequenceSlice],
                                                                runs: bool) -> None:
    _prefilled(native, 8)
    calls = _count_loop_calls(native)
    native.forward(Batch(batch, BS))
    assert calls[0] == (1 if runs else 0)


def test_hybrid_runs_the_loop_for_one_row_only(hybrid: CPUBackend) -> None:
    # From 2 rows hybrid multiplies the dense weights (a GEMM), which the loop does not run.
    assert hybrid.model.decode_loop.max_rows == 1
    _prefilled(hybrid, 2)
    calls = _count_loop_calls(hybrid)
    hybrid.forward(Batch([_decode(0, 20)], BS))
    hybrid.forward(Batch([_decode(0, 21), _decode(1, 20)], BS))
    assert calls[0] == 1


def test_the_pass_runs_dense_models_and_skips_deterministic_ones_saying_why() -> None:
    dense = CPUBackend()
    info = dense.load(ModelSpec(name="d", path=default_model_path(), dtype="bfloat16", passes={"quantise": "bf16"}))
    record = next(r for r in info.passes if r["name"] == "decode_loop")
    assert record["status"] == "ran" and dense.model.decode_loop is not None
    assert dense.model.decode_loop.max_rows == 64  # MAX_ROWS: no quantised projection bounds it
    det = CPUBackend()
    info = det.load(ModelSpec(name="n", path=default_model_path(), dtype="bfloat16", passes={"quantise": "native"},
                              deterministic=True))
    record = next(r for r in info.passes if r["name"] == "decode_loop")
    assert record["status"] == "skipped" and "deterministic" in record["detail"] and det.model.decode_loop is None


def test_decode_loop_false_keeps_every_step_in_python() -> None:
    backend = CPUBackend()
    info = backend.load(ModelSpec(name="d", path=default_model_path(), dtype="bfloat16",
                                  passes={"decode_loop": False}))
    record = next(r for r in info.passes if r["name"] == "decode_loop")
    assert record["status"] == "skipped" and "decode_loop: false" in record["detail"]
    assert backend.model.decode_loop is None


def test_a_projection_with_a_forward_of_its_own_keeps_the_model_off_the_loop() -> None:
    from inferflux.backends.cpu.decode_loop import why_not

    backend = _load("bf16")
    assert why_not(backend.model) is None
    down = backend.model.layers[7].mlp.down
    down.forward = lambda x: torch.nn.functional.linear(x, down.weight) * 2  # not an op the loop can stand for
    assert "neither ggml blocks nor a plain or packed dense linear" in why_not(backend.model)


def test_the_loop_takes_no_more_rows_than_below_gemm_from() -> None:
    backend = CPUBackend()
    backend.load(ModelSpec(name="g", path=default_model_path(), dtype="bfloat16",
                           passes={"quantise": "native", "gemm_from": 4}))
    backend.allocate_kv(10 * BLOCKS_PER_SEQ, BS)  # up to 10 sequences
    assert backend.model.decode_loop.max_rows == 3
    _prefilled(backend, 4)
    calls = _count_loop_calls(backend)
    backend.forward(Batch([_decode(s, 20) for s in range(3)], BS))
    backend.forward(Batch([_decode(s, 21) for s in range(4)], BS))  # 4 rows: the Python path's GEMM
    assert calls[0] == 1


def test_gemm_from_one_leaves_no_step_to_the_loop() -> None:
    backend = CPUBackend()
    info = backend.load(ModelSpec(name="g", path=default_model_path(), dtype="bfloat16",
                                  passes={"quantise": "native", "gemm_from": 1}))
    record = next(r for r in info.passes if r["name"] == "decode_loop")
    assert record["status"] == "skipped" and "gemm_from 1" in record["detail"] and backend.model.decode_loop is None


def test_another_kernel_set_drops_the_loop() -> None:
    from inferflux.kernels import reference

    backend = _load("native")
    assert backend.model.decode_loop is not None
    backend.model.use_kernels(reference)  # the loop calls the fast set's kernels: it cannot stand for another set
    assert backend.model.decode_loop is None


def test_the_loop_refuses_a_step_that_is_not_single_token_decodes(native: CPUBackend) -> None:
    _prefilled(native, 1)
    ids, meta, _ = native._prepare(Batch([_decode(0, 20)], BS))
    x = native.model.embed(ids)
    meta.decode_starts = meta.decode_starts - 1  # two tokens' worth of query: not what the loop runs
    with pytest.raises(RuntimeError, match="single-token"):
        native.model.decode_loop.run(x, meta, native.kv_caches)
