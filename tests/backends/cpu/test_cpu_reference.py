"""The CPU backend against transformers on the same GGUF, in float32.

Greedy output must match token for token; logits must not depend on what else
shares the batch (alone, batched, or joining a running batch mid-flight).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferflux.backends.base import Batch, ModelSpec, SequenceSlice
from inferflux.backends.cpu import CPUBackend
from inferflux.backends.engine import EngineConfig, LLMEngine, SamplingParams
from inferflux.backends.models import default_model_path, open_model

from greedy_runs import reference_prompts, run_greedy

BLOCK = 16


@pytest.fixture(scope="module")
def tokenizer():
    return open_model(default_model_path()).tokenizer()


@pytest.fixture(scope="module")
def loaded():
    be = CPUBackend()
    info = be.load(ModelSpec(name="smollm2", path=default_model_path(), dtype="float32"))
    assert info.dtype == "float32"
    return be, info


@pytest.fixture(scope="module")
def backend(loaded):
    return loaded[0]


@pytest.fixture(scope="module")
def info(loaded):
    return loaded[1]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return reference_prompts(tokenizer)


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with transformers' own KV cache. (``generate`` with
    ``min_new_tokens`` would mask end-of-sequence logits, which we do not.)"""
    out: list[int] = []
    with torch.no_grad():
        step = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            token = int(step.logits[0, -1].argmax())
            out.append(token)
            step = model(torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True)
    return out


def _run_engine(backend, info, tokenizer, requests: dict[str, list[int]], n: int, *, stagger: int = 0,
                stats_out: list | None = None, **config) -> dict[str, list[int]]:
    """Greedy ``n`` tokens per request through the real engine; with ``stagger``,
    each request is added ``stagger`` steps after the previous one. The engine's
    final stats go to ``stats_out`` when given."""
    engine = LLMEngine(backend, tokenizer, info, EngineConfig(**config))
    tokens = {rid: r["tokens"] for rid, r in run_greedy(engine, requests, n, stagger=stagger).items()}
    if stats_out is not None:
        stats_out.append(engine.stats())
    return tokens


def test_greedy_matches_transformers(backend, info, tokenizer, prompts, hf_causal_lm):
    expected = {f"p{i}": _hf_greedy(hf_causal_lm, ids, 32) for i, ids in enumerate(prompts)}
    got = _run_engine(backend, info, tokenizer, {f"p{i}": ids for i, ids in enumerate(prompts)}, 32)
    assert got == expected


def test_prefill_logits_match_transformers(backend, prompts, hf_causal_lm):
    backend.allocate_kv(64, BLOCK)
    ids = prompts[0]
    table = list(range(3, 3 + (len(ids) + BLOCK - 1) // BLOCK))
    ours = np.asarray(backend.forward(Batch([SequenceSlice(0, ids, 0, table, num_logits=len(ids))], BLOCK)))
    with torch.no_grad():
        ref = hf_causal_lm(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0)


def test_greedy_is_batch_invariant_through_the_engine(backend, info, tokenizer, prompts):
    requests = {f"p{i}": ids for i, ids in enumerate(prompts)}
    alone = {rid: _run_engine(backend, info, tokenizer, {rid: ids}, 24)[rid] for rid, ids in requests.items()}
    together = _run_engine(backend, info, tokenizer, requests, 24)
    # Joining mid-flight, with prompts split into chunks by a small step budget.
    staggered = _run_engine(backend, info, tokenizer, requests, 24, stagger=3, max_num_batched_tokens=20)
    assert together == alone
    assert staggered == alone


def _decode_logits(backend, runs: list[list[tuple[int, list[int]]]], steps: int) -> dict[int, list[np.ndarray]]:
    """Drive the backend directly: each inner list is a set of (seq, prompt) admitted
    together; groups are admitted one step apart, all then decode greedily."""
    backend.allocate_kv(256, BLOCK)
    next_block = 0
    state: dict[int, dict] = {}
    logits: dict[int, list[np.ndarray]] = {}
    for step in range(steps + len(runs)):
        slices = []
        if step < len(runs):
            for seq, ids in runs[step]:
                table = list(range(next_block, next_block + 8))
                next_block += 8
                state[seq] = {"ids": list(ids), "table": table, "done": 0}
                slices.append(SequenceSlice(seq, ids, 0, table, 1))
        for seq, st in state.items():
            if st["done"] and st["done"] < steps:
                slices.append(SequenceSlice(seq, st["ids"][-1:], len(st["ids"]) - 1, st["table"], 1))
        if not slices:
            break
        out = np.asarray(backend.forward(Batch(slices, BLOCK)))
        for row, sl in zip(out, slices):
            st = state[sl.seq_id]
            logits.setdefault(sl.seq_id, []).append(row)
            st["ids"].append(int(row.argmax()))
            st["done"] += 1
    return logits


def test_logits_are_batch_invariant(backend, prompts):
    steps = 6
    alone = {seq: _decode_logits(backend, [[(seq, ids)]], steps)[seq] for seq, ids in enumerate(prompts)}
    batched = _decode_logits(backend, [[(seq, ids) for seq, ids in enumerate(prompts)]], steps)
    joining = _decode_logits(backend, [[(0, prompts[0]), (1, prompts[1])], [(2, prompts[2])], [(3, prompts[3])]],
                             steps)
    for seq in alone:
        for mode in (batched, joining):
            assert len(mode[seq]) == len(alone[seq]) == steps
            for a, b in zip(alone[seq], mode[seq]):
                assert int(a.argmax()) == int(b.argmax())
                np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_compiled_attention_is_in_use_and_agrees_with_the_reference(backend, prompts):
    from inferflux.kernels import cpu as cpu_kernels
    from inferflux.kernels import reference

    # This machine has a compiler: a silent fall-back to the reference would hide a broken build.
    assert backend.kernel_error is None
    assert all(layer.attn.paged_attention is cpu_kernels.paged_attention for layer in backend.model.layers)
    runs = [[(0, prompts[0]), (1, prompts[1])], [(2, prompts[2])], [(3, prompts[3])]]
    compiled = _decode_logits(backend, runs, 6)
    backend.model.use_paged_attention(reference.paged_attention)
    try:
        plain = _decode_logits(backend, runs, 6)
    finally:
        backend.model.use_paged_attention(cpu_kernels.paged_attention)
    for seq in compiled:
        for a, b in zip(compiled[seq], plain[seq], strict=True):
            assert int(a.argmax()) == int(b.argmax())
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


SYSTEM_TEXT = (
    "You are the support assistant of a small bakery. Opening hours are seven to three on weekdays and eight "
    "to one on Saturdays; the shop is closed on Sundays and public holidays. Bread is baked twice a day. "
) * 12


def test_a_shared_system_prompt_is_prefilled_once_with_the_same_output(backend, info, tokenizer):
    system = tokenizer.encode(SYSTEM_TEXT)[:512]
    assert len(system) == 512
    questions = [" Question: when do you open on Saturday? Answer:", " Question: is there bread on Sunday? Answer:"]
    requests = [system + tokenizer.encode(q, add_special_tokens=False) for q in questions]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs, processed = {}, {}
    for enabled in (True, False):
        engine = LLMEngine(backend, tokenizer, info, EngineConfig(block_size=BLOCK, enable_prefix_caching=enabled))
        for i, ids in enumerate(requests):  # one after the other: the second finds the first's blocks
            before = engine.stats().num_tokens_processed
            engine.add_request(f"q{i}", ids, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    outputs.setdefault((enabled, i), []).extend(out.new_token_ids)
            processed[(enabled, i)] = engine.stats().num_tokens_processed - before
        if enabled:
            assert engine.stats().prefix_cache_hit_tokens == 512
    for i, ids in enumerate(requests):
        assert outputs[(True, i)] == outputs[(False, i)]
        assert processed[(False, i)] == len(ids) + 11  # the whole prompt, then 11 decode steps
    assert processed[(True, 0)] == len(requests[0]) + 11
    assert processed[(True, 1)] == len(requests[1]) - 512 + 11  # the system prompt was not run again


def test_speculative_greedy_equals_plain_greedy(backend, info, tokenizer, prompts):
    from inferflux.backends.engine.speculative import SpeculativeConfig

    copying = [
        tokenizer.encode("Copy the list exactly.\nList: red, green, blue, yellow, purple, orange.\nCopy: red, green,"),
        tokenizer.encode("def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return"),
    ]
    requests = {f"p{i}": ids for i, ids in enumerate(prompts + copying)}
    plain = _run_engine(backend, info, tokenizer, requests, 24)
    # A draft model of its own: the same weights loaded again, so nearly every draft is kept.
    draft_backend = CPUBackend()
    draft_backend.load(ModelSpec(name="draft", path=default_model_path(), dtype="float32"))
    same_model = SpeculativeConfig(method="draft", draft_model="smollm2", k=3)
    # A self-draft, the first 20 of 30 layers: far less often right, but never wrong in effect.
    self_draft = SpeculativeConfig(method="draft", draft_layers=20, k=2)
    configs = {"ngram-2": (SpeculativeConfig(k=2), None), "ngram-5": (SpeculativeConfig(k=5), None),
               "draft-model": (same_model, draft_backend), "self-draft": (self_draft, None)}  # fmt: skip
    for name, (config, draft) in configs.items():
        engine = LLMEngine(backend, tokenizer, info, EngineConfig(speculative=config), draft_backend=draft)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        for rid, ids in requests.items():
            engine.add_request(rid, ids, params)
        got: dict[str, list[int]] = {rid: [] for rid in requests}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
        stats = engine.stats()
        assert stats.spec_proposed_tokens > 0, name
        if name != "self-draft":
            assert stats.spec_accepted_tokens > 0, name
        if name == "draft-model":
            assert stats.spec_accepted_tokens >= 0.9 * stats.spec_proposed_tokens
        assert got == plain, name


def test_a_run_that_exhausts_kv_memory_gives_the_same_outputs_with_swap_and_recompute(
    backend, info, tokenizer, prompts, tmp_path
):
    requests = {f"p{i}": ids for i, ids in enumerate(prompts)}
    ample = _run_engine(backend, info, tokenizer, requests, 24, block_size=BLOCK)
    tight = dict(block_size=BLOCK, num_blocks=8, max_num_batched_tokens=64)
    assert _run_engine(backend, info, tokenizer, requests, 24, **tight) == ample  # recompute
    for swap_dir in (None, str(tmp_path)):  # host memory, then the disk tier
        stats: list = []
        swapped = _run_engine(backend, info, tokenizer, requests, 24, stats_out=stats, preemption_mode="swap",
                              swap_dir=swap_dir, **tight)  # fmt: skip
        assert swapped == ample, swap_dir
        assert stats[0].num_swap_outs > 0
        assert stats[0].num_swapped_in_blocks == stats[0].num_swapped_out_blocks
    assert list(tmp_path.iterdir()) == []  # the swap file was unlinked from the start


def test_rope_tables_give_rope_cos_sin_of_each_position_and_grow_past_their_end(backend):
    from inferflux.kernels.reference import rope_cos_sin

    pos = torch.tensor([0, 7, 1023, 5])
    cos, sin = backend._rope(pos, 1024)
    first = backend._rope_tables[0].shape[0]
    want_cos, want_sin = rope_cos_sin(pos, backend.inv_freq, backend.dtype)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    far = torch.tensor([3, first + 17, 2 * first + 1])  # past the table: it grows (doubling) to hold them
    cos, sin = backend._rope(far, 2 * first + 2)
    assert backend._rope_tables[0].shape[0] >= 2 * first + 2
    want_cos, want_sin = rope_cos_sin(far, backend.inv_freq, backend.dtype)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
