"""Speculative decoding with a draft model: the same greedy tokens, and the draft's own KV kept right.

Target and draft are paged echo backends, each computing logits only from the
context it reads back through its own block tables: a draft whose KV went
stale after a rejection proposes other tokens, which the target then rejects.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from inferflux.backends.engine import EngineConfigError, SamplingParams
from inferflux.backends.engine.speculative import SpeculativeConfig

from engine_testkit import (
    PagedEchoBackend,
    check_scheduler_invariants,
    context_hash,
    echo_logits,
    induction_logits,
    make_engine,
    reference_greedy,
)
from test_engine_speculative import copy_prompts, run

TARGET = functools.partial(induction_logits, peak=8.0)


def half_right(ctx: np.ndarray, vocab: int) -> np.ndarray:
    """A draft model that agrees with the target at two contexts in three, and not at the third."""
    if context_hash(ctx) % 3 == 0:
        row = echo_logits(ctx[::-1].copy(), vocab)
        row[int(np.argmax(TARGET(ctx, vocab)))] = -1e9
        return row
    return TARGET(ctx, vocab)


def draft_config(k: int, **extra) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", draft_model="test-draft", k=k, **extra)


def greedy_requests(n: int, seed: int, max_tokens: int = 24) -> dict[str, tuple[list[int], SamplingParams]]:
    requests = {}
    for i, prompt in enumerate(copy_prompts(n, seed)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                speculative_k=0 if i % 4 == 0 else None)  # fmt: skip
        requests[f"r{i}"] = (prompt, params)
    return requests


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_with_a_draft_model_is_plain_greedy(k: int) -> None:
    requests = greedy_requests(16, seed=k)
    draft = PagedEchoBackend(logits_fn=half_right)
    engine, _ = make_engine(block_size=4, num_blocks=80, max_num_seqs=8, max_num_batched_tokens=48,
                            speculative=draft_config(k), logits_fn=TARGET, draft_backend=draft)  # fmt: skip
    got = run(engine, requests, stagger=2)
    for rid, (prompt, _) in requests.items():
        assert got[rid] == reference_greedy(prompt, 24, eos=None, logits_fn=TARGET), rid
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens  # both outcomes happened
    assert engine.scheduler.num_preemptions > 0
    # Finished sequences gave back the draft's KV too.
    assert engine.speculator.proposer.block_manager.num_used_blocks == 0


def test_a_draft_identical_to_the_target_is_always_accepted() -> None:
    # Any draft KV left stale by a rollback, or lost to preemption, would make the
    # draft disagree with the target somewhere.
    requests = greedy_requests(8, seed=21, max_tokens=40)
    engine, _ = make_engine(block_size=4, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=64,
                            speculative=draft_config(4), logits_fn=TARGET,
                            draft_backend=PagedEchoBackend(logits_fn=TARGET))  # fmt: skip
    got = run(engine, requests)
    for rid, (prompt, _) in requests.items():
        assert got[rid] == reference_greedy(prompt, 40, eos=None, logits_fn=TARGET), rid
    stats = engine.stats()
    assert stats.spec_proposed_tokens > 100
    assert stats.spec_accepted_tokens == stats.spec_proposed_tokens


def test_the_batch_drafts_together_one_forward_per_draft_position() -> None:
    requests = {f"r{i}": (prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
                for i, prompt in enumerate(copy_prompts(4, seed=3))}  # fmt: skip
    draft = PagedEchoBackend(logits_fn=TARGET)
    engine, _ = make_engine(block_size=4, num_blocks=128, max_num_batched_tokens=4096, speculative=draft_config(3),
                            logits_fn=TARGET, draft_backend=draft)  # fmt: skip
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    engine.step()  # the four prefills
    drafted = engine.step()
    assert all(len(out.new_token_ids) == 4 for out in drafted)  # 3 accepted + the target's own token
    # Four sequences, three draft positions: three forwards, the first a catch-up of the prompts.
    assert len(draft.batches) == 3
    assert [len(b.slices) for b in draft.batches] == [4, 4, 4]
    assert all(len(s.token_ids) > 1 for s in draft.batches[0].slices)


def test_aborting_a_request_frees_its_draft_kv() -> None:
    engine, _ = make_engine(block_size=4, num_blocks=64, speculative=draft_config(2), logits_fn=TARGET,
                            draft_backend=PagedEchoBackend(logits_fn=TARGET))  # fmt: skip
    engine.add_request("a", copy_prompts(1, seed=4)[0], SamplingParams(temperature=0.0, max_tokens=30))
    engine.step()
    engine.step()
    proposer = engine.speculator.proposer
    assert proposer.block_manager.num_used_blocks > 0
    engine.abort_request("a")
    assert proposer.block_manager.num_used_blocks == 0 and not proposer.shadows


def test_draft_configuration_errors_are_clear() -> None:
    with pytest.raises(EngineConfigError, match="draft_layers or draft_model"):
        SpeculativeConfig(method="draft").check()
    with pytest.raises(EngineConfigError, match="draft_layers or draft_model"):
        SpeculativeConfig(method="draft", draft_layers=2, draft_model="x").check()
    with pytest.raises(EngineConfigError, match="method 'draft' only"):
        SpeculativeConfig(draft_layers=2).check()
    with pytest.raises(EngineConfigError, match="positive integer"):
        SpeculativeConfig(method="draft", draft_layers=0).check()
    with pytest.raises(EngineConfigError, match="was not loaded"):
        make_engine(speculative=draft_config(2))
    with pytest.raises(EngineConfigError, match="cannot run a self-draft"):
        make_engine(speculative=SpeculativeConfig(method="draft", draft_layers=2))


def test_invariants_hold_while_drafting_under_memory_pressure() -> None:
    requests = greedy_requests(12, seed=8)
    engine, _ = make_engine(block_size=2, num_blocks=60, max_num_seqs=6, max_num_batched_tokens=32,
                            speculative=draft_config(4), logits_fn=TARGET,
                            draft_backend=PagedEchoBackend(logits_fn=half_right), preemption_mode="swap")  # fmt: skip
    seqs = []
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
        seqs.append(engine._requests[rid])
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        check_scheduler_invariants(engine.scheduler, seqs)
    for rid, (prompt, _) in requests.items():
        assert got[rid] == reference_greedy(prompt, 24, eos=None, logits_fn=TARGET), rid
    assert engine.stats().num_swap_outs > 0
