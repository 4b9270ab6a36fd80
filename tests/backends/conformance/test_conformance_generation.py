"""Every backend through the real engine: greedy output equals the CPU backend's float32
greedy output, and does not depend on batching, chunking, preemption or aborts.

Exact token equality is the bar: in float32 every backend computes the same model,
and 16 greedy tokens over four prompts (7 to 37 tokens long, each crossing a block
boundary) would expose a wrong position, mask, block lookup or stale KV block at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conformance_kit import BLOCK, MAX_TOKENS, blocks_for

from inferflux.backends.base import Batch, SequenceSlice
from inferflux.backends.engine import EngineConfig, LLMEngine, SamplingParams


def _requests(prompts: list[list[int]]) -> dict[str, list[int]]:
    return {f"p{i}": ids for i, ids in enumerate(prompts)}


def _expected(oracle_tokens: list[list[int]]) -> dict[str, list[int]]:
    return {f"p{i}": tokens for i, tokens in enumerate(oracle_tokens)}


def test_greedy_tokens_equal_the_float32_oracle(backend_name, run_engine, prompts, oracle_tokens):
    got = run_engine(_requests(prompts))
    assert got == _expected(oracle_tokens)


def test_greedy_tokens_do_not_depend_on_the_batch(backend_name, run_engine, prompts, oracle_tokens):
    """Requests joining a running batch every third step, their prompts cut into chunks by
    a small step budget, get the tokens each prompt gets alone (the oracle runs them alone)."""
    mixed = run_engine(_requests(prompts), stagger=3, max_num_batched_tokens=20)
    assert mixed == _expected(oracle_tokens)


def _decode_logits(backend: Any, groups: list[list[tuple[int, list[int]]]], steps: int) -> dict[int, np.ndarray]:
    """Drive the backend directly: each group of (seq, prompt) is admitted one step
    after the previous; every admitted sequence then decodes greedily."""
    backend.allocate_kv(64, BLOCK)
    state: dict[int, tuple[list[int], list[int]]] = {}
    rows: dict[int, list[np.ndarray]] = {}
    next_block = 0
    for step in range(steps + len(groups)):
        slices = []
        for seq, ids in groups[step] if step < len(groups) else ():
            table = list(range(next_block, next_block + 8))
            next_block += 8
            state[seq] = (list(ids), table)
            slices.append(SequenceSlice(seq, ids, 0, table, 1))
        for seq, (ids, table) in state.items():
            if seq in rows and len(rows[seq]) < steps:
                slices.append(SequenceSlice(seq, ids[-1:], len(ids) - 1, table, 1))
        if not slices:
            break
        out = np.asarray(backend.forward(Batch(slices, BLOCK)), dtype=np.float32)
        for row, sl in zip(out, slices, strict=True):
            rows.setdefault(sl.seq_id, []).append(row)
            state[sl.seq_id][0].append(int(row.argmax()))
    return {seq: np.stack(r) for seq, r in rows.items()}


def test_logits_do_not_depend_on_the_batch(backend_name, loaded, prompts):
    """Logits of one sequence alone, in a batch, and joined by others mid-flight.
    Tolerance 1e-4 (float32; a backend may pick other matmul shapes per batch size)."""
    backend, _ = loaded
    steps = 5
    alone = {seq: _decode_logits(backend, [[(seq, ids)]], steps)[seq] for seq, ids in enumerate(prompts)}
    batched = _decode_logits(backend, [list(enumerate(prompts))], steps)
    joining = _decode_logits(backend, [[(0, prompts[0]), (1, prompts[1])], [(2, prompts[2])], [(3, prompts[3])]],
                             steps)
    for seq, rows in alone.items():
        for other in (batched[seq], joining[seq]):
            assert other.shape == rows.shape == (steps, rows.shape[1])
            np.testing.assert_array_equal(other.argmax(axis=1), rows.argmax(axis=1))
            np.testing.assert_allclose(other, rows, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", [
    pytest.param({"preemption_mode": "recompute", "enable_prefix_caching": False}, id="recompute"),
    pytest.param({"preemption_mode": "recompute"}, id="recompute-prefix-cache"),
    pytest.param({"preemption_mode": "swap"}, id="swap-host"),
    pytest.param({"preemption_mode": "swap", "swap_dir": "TMP"}, id="swap-disk"),
])
def test_outputs_survive_preemption(backend_name, loaded, run_engine, prompts, oracle_tokens, tmp_path, mode):
    """A KV pool far too small for the four sequences at once: they are preempted
    (and readmitted) over and over, and still produce exactly the oracle's tokens."""
    backend, _ = loaded
    config = dict(mode)
    if config["preemption_mode"] == "swap" and not hasattr(backend, "allocate_swap"):
        pytest.skip(f"the {backend_name} backend has no allocate_swap (the optional swap seam in backends/base.py)")
    if config.get("swap_dir") == "TMP":
        config["swap_dir"] = str(tmp_path)
    # Room for every prompt at admission, not for what they grow to.
    num_blocks = sum(blocks_for(len(ids)) for ids in prompts)
    assert num_blocks < sum(blocks_for(len(ids) + MAX_TOKENS - 1) for ids in prompts)
    got = run_engine(_requests(prompts), num_blocks=num_blocks, **config)
    stats = run_engine.last.stats()
    assert stats.num_preemptions > 0
    if config["preemption_mode"] == "swap":
        assert stats.num_swap_outs > 0 and stats.num_swapped_in_blocks > 0, "no KV went through swap space"
    assert got == _expected(oracle_tokens)


def test_abort_frees_blocks_and_leaves_the_others_unchanged(backend_name, loaded, tokenizer, prompts, oracle_tokens):
    backend, info = loaded
    # Room for three of the four sequences: the fourth can only run in the victim's blocks.
    need = [blocks_for(len(ids) + MAX_TOKENS - 1) for ids in prompts]
    num_blocks = need[0] + need[2] + max(need[1], need[3])
    engine = LLMEngine(backend, tokenizer, info, EngineConfig(block_size=BLOCK, num_blocks=num_blocks))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    requests = _requests(prompts)
    for rid in ("p0", "p1", "p2"):
        engine.add_request(rid, requests[rid], params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    while len(tokens["p1"]) < MAX_TOKENS // 2:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)

    used = engine.stats().num_blocks_used
    victim_blocks = len(next(seq for seq in engine.scheduler.running if seq.request_id == "p1").block_table)
    assert victim_blocks > 0
    final = engine.abort_request("p1")
    assert final is not None and final.finish_reason == "abort"
    assert engine.stats().num_blocks_used == used - victim_blocks
    assert "p1" not in engine.request_ids

    engine.add_request("p3", requests["p3"], params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "p1", "an aborted request produced output"
            tokens[out.request_id].extend(out.new_token_ids)
    assert engine.stats().num_blocks_used == 0
    assert engine.stats().num_preemptions == 0  # p3 ran in the freed blocks, not by evicting anyone
    expected = _expected(oracle_tokens)
    for rid in ("p0", "p2", "p3"):
        assert tokens[rid] == expected[rid], rid
    assert tokens["p1"] == expected["p1"][: len(tokens["p1"])]
