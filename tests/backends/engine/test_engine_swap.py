"""Preemption by swap: parked KV comes back intact, outputs do not change, and the books stay balanced.

The paged echo backend poisons a block once it is swapped out and a slot once it
is swapped in, and computes logits only from what it reads back through the
block tables, so a lost, stale or misplaced block changes the output.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from inferflux.backends.engine import BlockManager, EngineConfigError, LLMEngine, SamplingParams, Sequence, SequenceStatus
from inferflux.backends.engine.speculative import SpeculativeConfig

from engine_testkit import (
    CharTokenizer,
    PagedEchoBackend,
    check_block_invariants,
    check_scheduler_invariants,
    induction_logits,
    make_engine,
    model_info,
    reference_greedy,
    run_to_completion,
)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def tokens_run_for(backend: PagedEchoBackend, seq_id: int) -> int:
    return sum(len(s.token_ids) for b in backend.batches for s in b.slices if s.seq_id == seq_id)


WORK = [([i + 1] * 6 + [30 + i, 40 + i], 14) for i in range(5)]


def run_checked(engine: LLMEngine, work, priorities=None) -> dict[str, list[int]]:
    seqs = []
    for i, (prompt, n) in enumerate(work):
        engine.add_request(f"r{i}", prompt, greedy(n), priority=priorities[i] if priorities else 0)
        seqs.append(engine._requests[f"r{i}"])
    got: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        check_scheduler_invariants(engine.scheduler, seqs)
    return got


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_run_that_exhausts_kv_memory_gives_the_same_outputs_with_swap_and_with_recompute(prefix_caching):
    expected = {f"r{i}": reference_greedy(p, n, eos=None) for i, (p, n) in enumerate(WORK)}
    outputs, stats = {}, {}
    for mode in ("recompute", "swap"):
        engine, _ = make_engine(
            block_size=2, num_blocks=16, max_num_seqs=5, max_num_batched_tokens=16,
            enable_prefix_caching=prefix_caching, preemption_mode=mode,
        )  # fmt: skip
        outputs[mode] = run_checked(engine, WORK)
        stats[mode] = engine.stats()
    assert outputs["recompute"] == expected
    assert outputs["swap"] == expected
    assert stats["recompute"].num_preemptions > 0 and stats["recompute"].num_swap_outs == 0
    assert stats["swap"].num_swap_outs > 0
    # Everything parked came back (nothing was aborted), and no slot is still held.
    assert stats["swap"].num_swapped_in_blocks == stats["swap"].num_swapped_out_blocks > 0
    assert stats["swap"].num_swapped == 0


def test_a_swapped_sequence_resumes_where_it_stopped_instead_of_prefilling_again() -> None:
    runs = {}
    for mode in ("recompute", "swap"):
        engine, backend = make_engine(
            block_size=2, num_blocks=16, max_num_seqs=5, max_num_batched_tokens=16,
            enable_prefix_caching=False, preemption_mode=mode,
        )  # fmt: skip
        run_checked(engine, WORK)
        runs[mode] = [tokens_run_for(backend, i) for i in range(len(WORK))]
    # Without a re-prefill every token runs through the model exactly once (the
    # last sampled token never does).
    assert runs["swap"] == [len(p) + n - 1 for p, n in WORK]
    assert sum(runs["recompute"]) > sum(runs["swap"])


def test_kv_operations_reach_the_backend_in_the_order_they_were_decided() -> None:
    engine, backend = make_engine(
        block_size=2, num_blocks=16, max_num_seqs=5, max_num_batched_tokens=16, enable_prefix_caching=False,
        preemption_mode="swap",
    )  # fmt: skip
    run_checked(engine, WORK)
    kinds = [kind for kind, _ in backend.kv_ops]
    assert "swap_out" in kinds and "swap_in" in kinds
    # Every slot is written before it is read, and read once per write.
    written: set[int] = set()
    for kind, pairs in backend.kv_ops:
        for a, b in pairs:
            if kind == "swap_out":
                assert b not in written
                written.add(b)
            elif kind == "swap_in":
                written.remove(a)
    assert not written


def test_too_little_swap_space_falls_back_to_recompute() -> None:
    engine, backend = make_engine(
        block_size=2, num_blocks=16, max_num_seqs=5, max_num_batched_tokens=16, enable_prefix_caching=False,
        preemption_mode="swap", num_swap_blocks=1,
    )  # fmt: skip
    got = run_checked(engine, WORK)
    assert got == {f"r{i}": reference_greedy(p, n, eos=None) for i, (p, n) in enumerate(WORK)}
    stats = engine.stats()
    assert stats.num_preemptions > stats.num_swap_outs  # some had to be recomputed
    assert engine.block_manager.num_free_swap_slots == 1


def test_aborting_a_swapped_sequence_gives_back_its_slots() -> None:
    engine, backend = make_engine(
        block_size=2, num_blocks=16, max_num_seqs=5, max_num_batched_tokens=16, enable_prefix_caching=False,
        preemption_mode="swap",
    )  # fmt: skip
    for i, (prompt, n) in enumerate(WORK):
        engine.add_request(f"r{i}", prompt, greedy(n))
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0]
    held = len(victim.swap_slots)
    free_before = engine.block_manager.num_free_swap_slots
    out = engine.abort_request(victim.request_id)
    assert out is not None and out.finish_reason == "abort"
    assert victim.status is SequenceStatus.FINISHED_ABORTED and not victim.swap_slots
    assert engine.block_manager.num_free_swap_slots == free_before + held
    rest = run_to_completion(engine)
    for i, (prompt, n) in enumerate(WORK):
        if f"r{i}" != victim.request_id:
            assert len(rest[f"r{i}"]["tokens"]) > 0
    assert engine.block_manager.num_free_swap_slots == engine.block_manager.num_swap_slots


def test_a_prefill_swapped_out_half_way_resumes_with_blocks_for_its_whole_prompt() -> None:
    # Found by the property test below (seed 499, block size 1). Step 0 prefills the
    # short r0 and the first chunk of the long, less important r1 (6 blocks, all of
    # them). Step 1: r0's decode needs a block, so r1 is swapped out with 2 of its 10
    # prompt tokens computed. It may only come back with blocks for all 10: swapped in
    # with room for just the next chunk, the chunk after it (scheduled as a continuing
    # prefill, which takes no blocks) ran past the end of its block table.
    engine, backend = make_engine(
        block_size=2, num_blocks=6, max_num_seqs=4, max_num_batched_tokens=4, enable_prefix_caching=False,
        preemption_mode="swap",
    )  # fmt: skip
    work = [([1, 2], 3), ([3 + i for i in range(10)], 2)]
    got = run_checked(engine, work, priorities=[0, 1])
    assert got == {f"r{i}": reference_greedy(p, n, eos=None) for i, (p, n) in enumerate(work)}
    # One block (2 of r1's 10 prompt tokens) went out, and came back.
    assert [(kind, len(pairs)) for kind, pairs in backend.kv_ops] == [("swap_out", 1), ("swap_in", 1)]
    assert engine.stats().num_swap_outs == engine.stats().num_preemptions == 1
    # It resumed where it stopped: every token ran once, no re-prefill.
    assert tokens_run_for(backend, 1) == len(work[1][0]) + work[1][1] - 1
    check_block_invariants(engine.block_manager, [])


def test_swap_with_speculative_drafts_keeps_greedy_outputs() -> None:
    r = random.Random(5)
    work = [([r.randrange(1, 9) for _ in range(10)], 16) for _ in range(5)]
    engine, _ = make_engine(
        block_size=2, num_blocks=20, max_num_seqs=5, max_num_batched_tokens=24, preemption_mode="swap",
        logits_fn=induction_logits, speculative=SpeculativeConfig(k=4),
    )  # fmt: skip
    got = run_checked(engine, work)
    assert got == {f"r{i}": reference_greedy(p, n, eos=None, logits_fn=induction_logits)
                   for i, (p, n) in enumerate(work)}
    stats = engine.stats()
    assert stats.num_swap_outs > 0 and stats.spec_proposed_tokens > 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    capacity=st.integers(20, 48),  # KV tokens: one request needs up to 19
    block_size=st.sampled_from([1, 2, 4]),
    num_swap_blocks=st.integers(1, 40),
    prefix_caching=st.booleans(),
    aborts=st.lists(st.integers(0, 7), max_size=3),
)
# A prefill swapped out half-way, resumed without blocks for the rest of its prompt:
@example(seed=499, capacity=48, block_size=1, num_swap_blocks=30, prefix_caching=False, aborts=[0])
def test_random_workloads_with_swap_keep_outputs_and_books(
    seed, capacity, block_size, num_swap_blocks, prefix_caching, aborts
):
    num_blocks = -(-capacity // block_size)
    r = random.Random(seed)
    shared = [r.randrange(1, 256) for _ in range(6)]
    work = []
    for _ in range(8):
        prompt = (shared if r.random() < 0.5 else []) + [r.randrange(1, 256) for _ in range(r.randrange(1, 6))]
        work.append((prompt, r.randrange(1, 10)))
    engine, _ = make_engine(
        block_size=block_size, num_blocks=num_blocks, max_num_seqs=6, max_num_batched_tokens=12,
        enable_prefix_caching=prefix_caching, preemption_mode="swap", num_swap_blocks=num_swap_blocks,
    )  # fmt: skip
    seqs = []
    for i, (prompt, n) in enumerate(work):
        engine.add_request(f"r{i}", prompt, greedy(n), priority=r.randrange(0, 2))
        seqs.append(engine._requests[f"r{i}"])
    got: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step in aborts:
            engine.abort_request(f"r{r.randrange(len(work))}")
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        check_scheduler_invariants(engine.scheduler, seqs)
        step += 1
        assert step < 5_000
    for i, (prompt, n) in enumerate(work):
        if seqs[i].status is SequenceStatus.FINISHED_ABORTED:
            continue
        assert got[f"r{i}"] == reference_greedy(prompt, n, eos=None)
    bm = engine.block_manager
    assert bm.num_free_swap_slots == bm.num_swap_slots
    check_block_invariants(bm, [])


def test_block_manager_swap_round_trip_books() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=True, num_swap_slots=3)
    seq = Sequence(0, "a", [1, 2, 3, 4, 5], SamplingParams(), max_tokens=9)
    bm.allocate(seq)
    seq.num_computed_tokens = 5
    bm.commit(seq)
    assert bm.can_swap_out(seq)
    bm.swap_out(seq)
    assert seq.block_table == [] and len(seq.swap_slots) == 3 and bm.num_free_swap_slots == 0
    assert [kind for kind, _ in bm.take_ops()] == ["swap_out"]
    other = Sequence(1, "b", [1, 2, 3, 4, 9], SamplingParams(), max_tokens=9)
    assert not bm.can_swap_out(other)  # no computed KV: nothing to park
    bm.copies_done()
    assert bm.can_swap_in(seq)
    bm.swap_in(seq)
    assert len(seq.block_table) == 3 and not seq.swap_slots and bm.num_free_swap_slots == 3
    check_block_invariants(bm, [seq])


class BackendWithoutSwap:
    """Everything the engine needs to start, and no swap methods."""

    def kv_block_bytes(self, block_size: int) -> int:
        return 8 * block_size

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        pass


def test_swap_configuration_errors_are_clear() -> None:
    with pytest.raises(EngineConfigError, match="needs a backend that can swap"):
        LLMEngine(BackendWithoutSwap(), CharTokenizer(), model_info(), _config(preemption_mode="swap"))
    with pytest.raises(EngineConfigError, match="preemption_mode"):
        _config(preemption_mode="drop").check()
    with pytest.raises(EngineConfigError, match="not both"):
        _config(preemption_mode="swap", num_swap_blocks=4, swap_space_bytes=1024).check()
    with pytest.raises(EngineConfigError, match="smaller than one KV block"):
        LLMEngine(PagedEchoBackend(), CharTokenizer(), model_info(), _config(preemption_mode="swap", swap_space_bytes=4))


def _config(**kwargs):
    from inferflux.backends.engine import EngineConfig

    return EngineConfig(block_size=4, num_blocks=8, **kwargs)
