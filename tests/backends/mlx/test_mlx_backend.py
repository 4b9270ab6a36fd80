"""The MLX backend on the real default model (SmolLM2-135M GGUF), float32, against
the CPU backend: same greedy tokens through the engine, same logits within a small
tolerance, whatever else shares the batch; plus the paged-cache plumbing (continuation
chunks, copy_blocks, swapping) and its errors.

On Linux this runs mlx's CPU build; the Metal path of Apple silicon cannot run here.
"""

from __future__ import annotations

import numpy as np
import pytest

from inferflux.backends import registry
from inferflux.backends.base import Batch, BackendError, ModelSpec, SequenceSlice
from inferflux.backends.engine import EngineConfig, LLMEngine, SamplingParams
from inferflux.backends.mlx import MLXBackend
from inferflux.backends.models import default_model_path

from mlx_testkit import greedy

# Skipped, saying why, only where mlx is absent (it is a dev dependency on Linux and macOS).
pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'inferflux[mlx]')")

BLOCK = 4  # direct forward tests: short prompts still span several blocks
NEW_TOKENS = 8
# float32 on both sides, differing in summation order only: mlx vs cpu logits differed
# by at most 1.4e-4 (magnitudes up to ~38). A row batched with others vs alone came out
# bit-identical on mlx's CPU build; the same bound leaves room for kernels that tile by
# batch shape (Metal).
LOGITS_ATOL = 5e-4
RAW_PROMPTS = [
    "Once upon a time, in a land far away,",
    "def fibonacci(n):\n    ",
    "The three primary colours are",
]


@pytest.fixture(scope="module")
def prompts(smol_tokenizer) -> dict[str, list[int]]:
    """Greedy runs through the engine (block size 16)."""
    return {f"raw{i}": smol_tokenizer.encode(p) for i, p in enumerate(RAW_PROMPTS)}


@pytest.fixture(scope="module")
def chat(smol_tokenizer) -> list[int]:
    """A templated chat prompt (37 tokens), for the direct forward tests."""
    text = smol_tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                              add_generation_prompt=True)
    return smol_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def mlx_together(mlx_loaded, smol_tokenizer, prompts):
    backend, info = mlx_loaded
    return greedy(backend, info, smol_tokenizer, prompts, NEW_TOKENS)


def test_probe_discovery_and_model_info(mlx_loaded, cpu_loaded):
    assert MLXBackend.probe() is None
    assert registry.get_backend("mlx") is MLXBackend  # the pyproject entry point
    _, info = mlx_loaded
    assert info.dtype == "float32"  # "auto" would also be float32 on Linux
    assert info == cpu_loaded[1]


def test_greedy_tokens_match_the_cpu_backend(mlx_together, cpu_loaded, smol_tokenizer, prompts):
    cpu = greedy(*cpu_loaded, smol_tokenizer, prompts, NEW_TOKENS)
    for rid in prompts:
        assert len(mlx_together[rid]["tokens"]) == NEW_TOKENS
        assert mlx_together[rid]["tokens"] == cpu[rid]["tokens"], rid


def test_prefill_logits_match_the_cpu_backend(mlx_loaded, cpu_loaded, chat):
    table = [9, 2, 7, 0, 4, 11, 1, 5, 8, 3]  # 37 tokens in 10 blocks of 4, out of order
    batch = Batch([SequenceSlice(0, chat, 0, table, num_logits=8)], BLOCK)
    got = {}
    for name, backend in (("mlx", mlx_loaded[0]), ("cpu", cpu_loaded[0])):
        backend.allocate_kv(12, BLOCK)
        got[name] = np.asarray(backend.forward(batch))
    assert got["mlx"].dtype == np.float32 and got["mlx"].shape == (8, 49152)
    np.testing.assert_allclose(got["mlx"], got["cpu"], atol=LOGITS_ATOL, rtol=0)
    assert (got["mlx"].argmax(-1) == got["cpu"].argmax(-1)).all()


def test_greedy_is_batch_invariant(mlx_loaded, mlx_together, smol_tokenizer, prompts):
    backend, info = mlx_loaded
    for rid, ids in prompts.items():
        alone = greedy(backend, info, smol_tokenizer, {rid: ids}, NEW_TOKENS)
        assert alone[rid]["tokens"] == mlx_together[rid]["tokens"], rid
    # Joining mid-flight under a small token budget: prompts are split into chunks that
    # continue cached context, in the same steps as other sequences' decodes.
    staggered = greedy(backend, info, smol_tokenizer, prompts, NEW_TOKENS, stagger=2, max_num_batched_tokens=10)
    assert {rid: r["tokens"] for rid, r in staggered.items()} == {
        rid: r["tokens"] for rid, r in mlx_together.items()}


def test_preemption_by_swapping_keeps_greedy_output(mlx_loaded, mlx_together, smol_tokenizer, prompts, tmp_path):
    """Too few blocks for all three sequences: the engine swaps one out (to a file,
    the disk tier) and back in, and the tokens do not change."""
    backend, info = mlx_loaded
    engine = LLMEngine(backend, smol_tokenizer, info, EngineConfig(
        block_size=4, num_blocks=9, preemption_mode="swap", num_swap_blocks=16, swap_dir=str(tmp_path)))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert engine.stats().num_swapped_in_blocks > 0
    assert got == {rid: r["tokens"] for rid, r in mlx_together.items()}


def test_continuation_chunks_match_a_full_prefill(mlx_loaded, chat):
    """Prefill in pieces (the later ones read the cached context through the block
    table, the shape speculative verification uses) vs one fresh prefill."""
    backend, _ = mlx_loaded
    ids = chat[:16]
    n = len(ids)
    backend.allocate_kv(16, BLOCK)
    full = np.asarray(backend.forward(Batch([SequenceSlice(0, ids, 0, [10, 11, 12, 13], n - 5)], BLOCK)))
    table = [9, 4, 1, 0]
    cuts = [0, 5, 11, n - 1, n]  # 5 new tokens, then 6 with a logits row each, then the rest, then one decode row
    pieces = []
    for a, b in zip(cuts, cuts[1:]):
        out = backend.forward(Batch([SequenceSlice(1, ids[a:b], a, table, num_logits=b - a if a else 0)], BLOCK))
        pieces.append(np.asarray(out))
    assert pieces[0].shape == (0, 49152)
    np.testing.assert_allclose(np.concatenate(pieces), full, atol=1e-4, rtol=0)


def test_a_mixed_batch_returns_rows_in_slice_order(mlx_loaded, prompts, chat):
    """A continuation, a fresh prefill and a decode row in one step, in an order that
    differs from how attention groups them, against each one run alone."""
    backend, _ = mlx_loaded
    a, b, c = prompts["raw2"], prompts["raw1"], chat[:14]
    tables = {0: [10, 3, 7], 1: [0, 12], 2: [1, 14, 5, 9]}
    setup = [SequenceSlice(1, b[:-1], 0, tables[1], 0), SequenceSlice(2, c[:10], 0, tables[2], 0)]
    step = [
        SequenceSlice(2, c[10:], 10, tables[2], num_logits=3),
        SequenceSlice(0, a, 0, tables[0], num_logits=2),
        SequenceSlice(1, b[-1:], len(b) - 1, tables[1], num_logits=1),
    ]
    backend.allocate_kv(16, BLOCK)
    backend.forward(Batch(setup, BLOCK))
    together = np.asarray(backend.forward(Batch(step, BLOCK)))
    backend.allocate_kv(16, BLOCK)
    alone = []
    for s in step:
        backend.forward(Batch([p for p in setup if p.seq_id == s.seq_id], BLOCK))
        alone.append(np.asarray(backend.forward(Batch([s], BLOCK))))
    alone = np.concatenate(alone)
    assert together.shape == (6, 49152)
    np.testing.assert_allclose(together, alone, atol=LOGITS_ATOL, rtol=0)
    assert (together.argmax(-1) == alone.argmax(-1)).all()


def _blocks(backend: MLXBackend, blocks: list[int]) -> np.ndarray:
    """Every layer's K and V of ``blocks`` as one host array."""
    return np.stack([np.stack((np.array(k[:, blocks]), np.array(v[:, blocks]))) for k, v in backend.kv_caches])


def test_copy_blocks_copies_every_layer(mlx_loaded, prompts):
    backend, _ = mlx_loaded
    ids = prompts["raw0"]  # 11 tokens: three blocks of 4
    backend.allocate_kv(12, BLOCK)
    backend.forward(Batch([SequenceSlice(0, ids[:-1], 0, [3, 4, 5], 0)], BLOCK))
    backend.copy_blocks([(3, 8), (4, 9), (5, 10)])
    original = _blocks(backend, [3, 4, 5])
    assert np.abs(original).max() > 0
    np.testing.assert_array_equal(_blocks(backend, [8, 9, 10]), original)
    assert not _blocks(backend, [0, 11]).any()  # nothing else was written
    last = [SequenceSlice(0, ids[-1:], len(ids) - 1, table, 1) for table in ([3, 4, 5], [8, 9, 10])]
    via_source = np.asarray(backend.forward(Batch([last[0]], BLOCK)))
    via_copy = np.asarray(backend.forward(Batch([last[1]], BLOCK)))
    np.testing.assert_array_equal(via_copy, via_source)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_swap_out_and_in_round_trips_blocks(mlx_loaded, prompts, tier, tmp_path):
    backend, _ = mlx_loaded
    ids, other = prompts["raw0"], prompts["raw1"]
    backend.allocate_kv(12, BLOCK)
    backend.allocate_swap(4, BLOCK, str(tmp_path) if tier == "disk" else None)
    assert isinstance(backend.swap, np.memmap) == (tier == "disk")
    backend.forward(Batch([SequenceSlice(0, ids[:-1], 0, [3, 4, 5], 0)], BLOCK))
    last = SequenceSlice(0, ids[-1:], len(ids) - 1, [3, 4, 5], 1)
    expected = np.asarray(backend.forward(Batch([last], BLOCK)))
    saved = _blocks(backend, [3, 4, 5])
    backend.swap_out([(3, 1), (4, 3), (5, 0)])
    # The blocks are reused by another sequence while the first is swapped out ...
    backend.forward(Batch([SequenceSlice(1, other, 0, [5, 4], 0)], BLOCK))
    assert not np.array_equal(_blocks(backend, [4, 5]), saved[:, :, :, 1:])
    # ... and it comes back into other blocks.
    backend.swap_in([(1, 7), (3, 2), (0, 9)])
    np.testing.assert_array_equal(_blocks(backend, [7, 2, 9]), saved)
    back = np.asarray(backend.forward(Batch([SequenceSlice(0, ids[-1:], len(ids) - 1, [7, 2, 9], 1)], BLOCK)))
    np.testing.assert_array_equal(back, expected)


def test_errors_are_backend_errors(mlx_loaded, tmp_path):
    fresh = MLXBackend()
    batch = Batch([SequenceSlice(0, [1, 2], 0, [0], 1)], BLOCK)
    with pytest.raises(BackendError, match="before load"):
        fresh.forward(batch)
    with pytest.raises(BackendError, match="no model loaded"):
        fresh.kv_block_bytes(BLOCK)
    with pytest.raises(BackendError, match="unsupported dtype 'float16'"):
        fresh.load(ModelSpec("m", default_model_path(), dtype="float16"))
    with pytest.raises(BackendError, match="does not exist"):
        fresh.load(ModelSpec("m", str(tmp_path / "missing.gguf")))
    with pytest.raises(BackendError, match="deterministic mode runs on the cpu backend only"):
        fresh.load(ModelSpec("m", default_model_path(), deterministic=True))

    backend, _ = mlx_loaded
    assert backend.kv_block_bytes(BLOCK) == 2 * 30 * BLOCK * 3 * 64 * 4
    backend.allocate_kv(4, BLOCK)
    with pytest.raises(BackendError, match="block size 8 != cache block size 4"):
        backend.forward(Batch([SequenceSlice(0, [1, 2], 0, [0], 1)], 8))
    with pytest.raises(BackendError, match="does not cover"):
        backend.forward(Batch([SequenceSlice(0, list(range(6)), 0, [0], 1)], BLOCK))
    with pytest.raises(BackendError, match="does not cover"):
        backend.forward(Batch([SequenceSlice(0, [1, 2], 0, [4], 1)], BLOCK))  # block 4 of 4
    with pytest.raises(BackendError, match="outside the cache"):
        backend.copy_blocks([(0, 9)])
    backend.swap = None
    with pytest.raises(BackendError, match="before allocate_swap"):
        backend.swap_out([(0, 0)])
