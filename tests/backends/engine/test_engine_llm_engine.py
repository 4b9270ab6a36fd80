"""LLMEngine end to end over the paged echo backend: any paging, block-table,
chunking or preemption bug changes the tokens, so outputs are compared with a
reference computed from the true token list."""

import random

import numpy as np
import pytest

from inferflux.backends.engine import (
    CacheCapacityError,
    DuplicateRequestError,
    EmptyPromptError,
    EngineConfig,
    EngineConfigError,
    InvalidPromptError,
    InvalidRequestError,
    LLMEngine,
    PromptTooLongError,
    SamplingParams,
    SamplingParamsError,
)

from engine_testkit import (
    EOS,
    CharTokenizer,
    PagedEchoBackend,
    check_scheduler_invariants,
    echo_logits,
    make_engine,
    model_info,
    reference_greedy,
    run_to_completion,
    solo_run,
)


def prompts(n: int, lo: int = 1, hi: int = 40, seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(1, 256) for _ in range(r.randrange(lo, hi + 1))] for _ in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_single_greedy_request_matches_reference():
    engine, _ = make_engine()
    p = prompts(1)[0]
    engine.add_request("a", p, greedy(30))
    res = run_to_completion(engine)["a"]
    ref = reference_greedy(p, 30)
    assert res["tokens"] == ref
    assert res["reason"] == ("stop" if ref[-1] == EOS else "length")
    assert res["text"] == CharTokenizer().decode(ref)
    assert engine.stats().num_blocks_used == 0


def test_continuous_batching_requests_join_mid_flight():
    engine, backend = make_engine(num_blocks=512, max_num_batched_tokens=64, max_num_seqs=8)
    ps = prompts(6, seed=1)
    results = {}
    engine.add_request("r0", ps[0], greedy(25))
    step = 0
    while engine.has_unfinished_requests() or step < 12:
        if step % 2 == 0 and step // 2 < len(ps) and step > 0:
            engine.add_request(f"r{step // 2}", ps[step // 2], greedy(25))
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    for i, p in enumerate(ps):
        assert results[f"r{i}"] == reference_greedy(p, 25), i
    # some step really mixed decodes with a new prefill
    assert any(
        any(len(s.token_ids) == 1 and s.start_pos > 0 for s in b.slices) and any(s.start_pos == 0 for s in b.slices)
        for b in backend.batches
    )


def test_chunked_prefill_for_a_prompt_longer_than_the_budget():
    engine, backend = make_engine(max_num_batched_tokens=7, block_size=4)
    p = prompts(1, lo=50, hi=50, seed=2)[0]
    engine.add_request("long", p, greedy(10))
    res = run_to_completion(engine)["long"]
    assert res["tokens"] == reference_greedy(p, 10)
    first = [s for b in backend.batches for s in b.slices][:8]
    assert [s.start_pos for s in first] == [0, 7, 14, 21, 28, 35, 42, 49]
    assert [s.num_logits for s in first] == [0] * 7 + [1]
    assert all(b.num_tokens <= 7 for b in backend.batches)


@pytest.mark.parametrize("num_blocks, block_size", [(12, 4), (48, 1), (6, 8)])
def test_preemption_by_recompute_keeps_outputs_identical(num_blocks, block_size):
    ps = prompts(8, lo=1, hi=20, seed=3)
    params = [
        SamplingParams(temperature=0.9, seed=100 + i, max_tokens=24, top_k=50 if i % 2 else 0, top_p=0.9)
        for i in range(len(ps))
    ]
    engine, _ = make_engine(num_blocks=num_blocks, block_size=block_size, max_num_seqs=6, max_num_batched_tokens=16)
    for i, (p, sp) in enumerate(zip(ps, params)):
        engine.add_request(f"r{i}", p, sp)
    res = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0
    for i, (p, sp) in enumerate(zip(ps, params)):
        solo = solo_run(p, sp)
        assert res[f"r{i}"]["tokens"] == solo["tokens"], i
        assert res[f"r{i}"]["text"] == solo["text"]
        assert res[f"r{i}"]["reason"] == solo["reason"]
    stats = engine.stats()
    assert stats.num_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def test_random_workload_with_invariants_every_step():
    r = random.Random(7)
    engine, _ = make_engine(num_blocks=16, block_size=2, max_num_seqs=5, max_num_batched_tokens=9)
    ps = prompts(12, lo=1, hi=12, seed=8)
    expected, got, aborted = {}, {}, set()
    pending = list(enumerate(ps))
    seqs = []
    for _ in range(2000):
        if pending and r.random() < 0.3:
            i, p = pending.pop(0)
            rid = f"r{i}"
            sp = greedy(r.randrange(1, 15))
            engine.add_request(rid, p, sp, priority=r.randrange(0, 3))
            seqs.append(engine._requests[rid])
            expected[rid] = reference_greedy(p, sp.max_tokens)
        if engine._requests and r.random() < 0.03:
            rid = r.choice(list(engine._requests))
            assert engine.abort_request(rid).finish_reason == "abort"
            aborted.add(rid)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        check_scheduler_invariants(engine.scheduler, seqs)
        if not pending and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    for rid, ref in expected.items():
        if rid in aborted:
            assert got.get(rid, []) == ref[: len(got.get(rid, []))]
        else:
            assert got[rid] == ref, rid
    assert engine.stats().num_blocks_free == 16


def test_seeded_sampling_is_independent_of_batch_mates():
    p = prompts(1, seed=9)[0]
    sp = SamplingParams(temperature=1.0, seed=42, max_tokens=30, ignore_eos=True)
    alone = solo_run(p, sp)
    engine, _ = make_engine()
    engine.add_request("x", p, sp)
    for i, q in enumerate(prompts(5, seed=10)):
        engine.add_request(f"mate{i}", q, SamplingParams(temperature=1.3, max_tokens=30))
    assert run_to_completion(engine)["x"]["tokens"] == alone["tokens"]
    assert alone["tokens"] != reference_greedy(p, 30, eos=None)  # it did sample


def test_abort_frees_blocks_and_reports_abort():
    engine, _ = make_engine(num_blocks=64)
    engine.add_request("a", prompts(1)[0], greedy(50, ignore_eos=True))
    engine.add_request("b", prompts(1, seed=1)[0], greedy(50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats().num_blocks_used > 0
    out = engine.abort_request("a")
    assert out.finished and out.finish_reason == "abort" and out.completion_tokens == 3
    assert engine.abort_request("a") is None and engine.abort_request("nope") is None
    engine.abort_request("b")
    stats = engine.stats()
    assert stats.num_blocks_used == 0 and not engine.has_unfinished_requests()
    engine.add_request("w", [1, 2], greedy(5))  # a waiting request aborts too
    assert engine.abort_request("w").finish_reason == "abort"
    assert engine.step() == []


def test_priorities_run_important_requests_first():
    engine, _ = make_engine(max_num_seqs=1)
    order = []
    for rid, prio in [("low1", 2), ("high", 0), ("low2", 2), ("mid", 1)]:
        engine.add_request(rid, [5, 6, 7], greedy(3, ignore_eos=True), priority=prio)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
    assert order == ["high", "mid", "low1", "low2"]


def test_important_request_preempts_and_everything_still_matches():
    engine, _ = make_engine(num_blocks=10, block_size=4, max_num_seqs=4)
    low = prompts(1, lo=20, hi=20, seed=11)[0]
    engine.add_request("low", low, greedy(15, ignore_eos=True), priority=5)
    for _ in range(3):
        engine.step()
    high = prompts(1, lo=20, hi=20, seed=12)[0]
    engine.add_request("high", high, greedy(15, ignore_eos=True), priority=0)
    res = run_to_completion(engine)
    assert engine.stats().num_preemptions >= 1
    assert res["high"]["tokens"] == reference_greedy(high, 15, eos=None)
    assert res["low"]["tokens"] == reference_greedy(low, 15, eos=None)[3:]


def test_tenants_share_the_batch_and_everything_still_matches():
    # a floods a 2-seat batch; b's one request is seated at once (preempting a's latest) and ends first
    engine, _ = make_engine(num_blocks=64, block_size=4, max_num_seqs=2)
    flood = prompts(6, lo=5, hi=12, seed=21)
    for i, p in enumerate(flood):
        engine.add_request(f"a{i}", p, greedy(12, ignore_eos=True), tenant="a")
    order: list[str] = []
    res: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            res.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                order.append(out.request_id)

    for _ in range(3):
        step()
    mine = prompts(1, lo=5, hi=12, seed=22)[0]
    engine.add_request("b", mine, greedy(4, ignore_eos=True), tenant="b", weight=1.0)
    while engine.has_unfinished_requests():
        step()
    assert order[0] == "b" and engine.stats().num_preemptions >= 1
    assert res["b"] == reference_greedy(mine, 4, eos=None)
    for i, p in enumerate(flood):
        assert res[f"a{i}"] == reference_greedy(p, 12, eos=None)


def test_tenant_and_weight_are_checked():
    engine, _ = make_engine()
    for weight in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("w", [1], greedy(1), weight=weight)
        assert info.value.param == "weight"
    with pytest.raises(TypeError):
        engine.add_request("t", [1], greedy(1), tenant=7)
    assert not engine.has_unfinished_requests()


def test_requests_that_can_never_fit_are_rejected_at_add_time():
    engine, _ = make_engine(num_blocks=4, block_size=4, context_length=64)
    with pytest.raises(CacheCapacityError) as info:
        engine.add_request("big", [1] * 10, greedy(8))  # 17 positions > 16 slots
    assert info.value.num_blocks == 4 and info.value.tokens_needed == 17
    assert "KV cache" in str(info.value)
    engine.add_request("fits", [1] * 10, greedy(7))  # 16 positions: exactly the cache
    with pytest.raises(PromptTooLongError) as info:
        engine.add_request("ctx", [1] * 60, greedy(5))
    assert (info.value.prompt_tokens, info.value.max_tokens, info.value.max_model_len) == (60, 5, 64)
    assert "65" in str(info.value)
    with pytest.raises(EmptyPromptError):
        engine.add_request("empty", [], greedy(5))
    with pytest.raises(InvalidPromptError):
        engine.add_request("oov", [1, 256], greedy(5))
    with pytest.raises(InvalidPromptError):
        engine.add_request("nonint", [1, "a"], greedy(5))
    with pytest.raises(SamplingParamsError):
        engine.add_request("bad", [1], SamplingParams(top_p=0))
    with pytest.raises(DuplicateRequestError):
        engine.add_request("fits", [1], greedy(1))
    with pytest.raises(InvalidRequestError):
        engine.add_request("prio", [1], greedy(1), priority="high")
    assert run_to_completion(engine)["fits"]["reason"] in ("length", "stop")


def test_max_tokens_none_runs_to_the_end_of_context_or_cache():
    engine, _ = make_engine(num_blocks=100, block_size=4, context_length=32)
    engine.add_request("ctx", [1] * 10, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    res = run_to_completion(engine)["ctx"]
    assert len(res["tokens"]) == 22 and res["reason"] == "length"
    engine, _ = make_engine(num_blocks=5, block_size=4, context_length=1000)
    engine.add_request("cache", [1] * 10, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(run_to_completion(engine)["cache"]["tokens"]) == 11  # 20 slots hold 10 + 10, +1 unfed
    with pytest.raises(CacheCapacityError):
        engine.add_request("x", [1] * 21, SamplingParams(max_tokens=None))
    with pytest.raises(PromptTooLongError):
        engine.add_request("y", [1] * 1000, SamplingParams(max_tokens=None))


def test_outputs_carry_counts_stop_strings_and_logprobs():
    engine, _ = make_engine()
    p = prompts(1, seed=13)[0]
    ref = reference_greedy(p, 20, eos=None)
    text = CharTokenizer().decode(ref)
    stop = text[8:10]
    engine.add_request("s", p, greedy(20, stop=[stop], ignore_eos=True, logprobs=True, top_logprobs=3))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].stop_string == stop
    assert all(o.stop_string is None for o in outs[:-1])
    assert "".join(o.new_text for o in outs) == text[: text.index(stop)]
    assert [o.completion_tokens for o in outs] == list(range(1, len(outs) + 1))
    assert all(o.prompt_tokens == len(p) for o in outs)
    ctx = list(p)
    for o in outs:
        (lp,) = o.logprobs
        row = echo_logits(np.asarray(ctx)).astype(np.float64)
        ref_lp = row - np.log(np.exp(row).sum())
        assert lp.token_id == o.new_token_ids[0] and lp.logprob == pytest.approx(ref_lp[lp.token_id], abs=1e-4)
        assert lp.token == CharTokenizer().decode([lp.token_id], skip_special_tokens=False)
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy picks the best
        ctx.append(lp.token_id)


def test_eos_finishes_with_stop():
    # find a prompt whose greedy continuation hits EOS quickly
    r = random.Random(0)
    for _ in range(5000):
        p = [r.randrange(1, 256) for _ in range(3)]
        ref = reference_greedy(p, 50)
        if ref[-1] == EOS and len(ref) < 50:
            break
    engine, _ = make_engine()
    engine.add_request("e", p, greedy(50))
    res = run_to_completion(engine)["e"]
    assert res["tokens"] == ref and res["reason"] == "stop"
    assert res["text"] == CharTokenizer().decode(ref[:-1])


def test_config_sizes_the_cache_from_bytes_and_validates():
    backend = PagedEchoBackend()
    engine = LLMEngine(backend, CharTokenizer(), model_info(), EngineConfig(block_size=16, kv_cache_bytes=16 * 8 * 10 + 5))
    assert engine.num_blocks == 10 and backend.cache.shape == (10, 16)
    for bad in (
        EngineConfig(num_blocks=4, kv_cache_bytes=100),
        EngineConfig(block_size=0, num_blocks=4),
        EngineConfig(kv_cache_bytes=10),
        EngineConfig(num_blocks=4, max_model_len=10**6),
        EngineConfig(num_blocks=4, max_num_batched_tokens=0),
    ):
        with pytest.raises(EngineConfigError):
            LLMEngine(PagedEchoBackend(), CharTokenizer(), model_info(), bad)


class EightTokenBlocks(PagedEchoBackend):
    default_block_size = 8


def test_block_size_defaults_to_the_backends_own():
    # Unset: the backend's default_block_size; a backend without one: 16; set: the setting wins.
    asks_for_8 = LLMEngine(EightTokenBlocks(), CharTokenizer(), model_info(), EngineConfig(num_blocks=6))
    assert asks_for_8.block_size == asks_for_8.config.block_size == 8
    assert asks_for_8.backend.cache.shape == (6, 8)
    plain = LLMEngine(PagedEchoBackend(), CharTokenizer(), model_info(), EngineConfig(num_blocks=6))
    assert plain.block_size == 16
    told = LLMEngine(EightTokenBlocks(), CharTokenizer(), model_info(), EngineConfig(num_blocks=6, block_size=32))
    assert told.block_size == 32 and told.backend.cache.shape == (6, 32)
    # The byte budget is divided by the block size the engine ends up with.
    by_bytes = LLMEngine(EightTokenBlocks(), CharTokenizer(), model_info(), EngineConfig(kv_cache_bytes=8 * 8 * 10))
    assert by_bytes.num_blocks == 10
    # Sequences still come out right with the smaller blocks (the echo backend reads its context back through them).
    p = prompts(1, seed=21)[0]
    asks_for_8.add_request("a", p, greedy(20, ignore_eos=True))
    assert run_to_completion(asks_for_8)["a"]["tokens"] == reference_greedy(p, 20, eos=None)


def test_backend_failure_leaves_the_engine_retryable():
    engine, backend = make_engine()
    p = prompts(1, seed=14)[0]
    engine.add_request("a", p, greedy(10, ignore_eos=True))
    engine.step()
    backend.fail_next = 1
    with pytest.raises(RuntimeError):
        engine.step()
    assert run_to_completion(engine)["a"]["tokens"] == reference_greedy(p, 10, eos=None)[1:]
