"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's logprob under the
model, from the logits of every prefill position, exact against the echo backend's logits
computed from the true token list, through chunked prefill, a warm prefix cache, preemption
by recompute and swap, and beside requests that want none. The real model's are checked
against transformers in tests/backends/conformance/test_conformance_prompt_logprobs.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from inferflux.backends.engine import SamplingParams, SamplingParamsError

from engine_testkit import echo_logits, make_engine, reference_greedy, run_to_completion

ATOL = 1e-5


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(1, 256) for _ in range(r.randrange(lo, hi + 1))] for _ in range(n)]


def expected(prompt: list[int], top: int) -> list[tuple[float, list[int]] | None]:
    """Each token's logprob under the logits of the tokens before it, and the ``top`` best ids there."""
    out: list[tuple[float, list[int]] | None] = [None]
    for i in range(1, len(prompt)):
        row = echo_logits(np.asarray(prompt[:i])).astype(np.float64)
        logp = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        out.append((float(logp[prompt[i]]), [int(t) for t in np.argsort(-logp, kind="stable")[:top]]))
    return out


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    """Every output's prompt_logprobs besides run_to_completion's tokens (a copy of its loop)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    seen: dict[str, dict] = {rid: {"tokens": [], "prompt_logprobs": [], "outputs": 0} for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            r = seen[out.request_id]
            r["tokens"] += out.new_token_ids
            r["outputs"] += 1
            if out.prompt_logprobs is not None:
                r["prompt_logprobs"].append((r["outputs"], out.prompt_logprobs))
    return seen


def check(got: list, prompt: list[int], top: int) -> None:
    """Sent once, in the first output, and equal to ``expected``."""
    assert len(got) == 1 and got[0][0] == 1, "prompt logprobs come once, with the first output"
    entries = got[0][1]
    want = expected(prompt, top)
    assert len(entries) == len(prompt) and entries[0] is None
    for i, (entry, w) in enumerate(zip(entries[1:], want[1:]), start=1):
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(w[0], abs=ATOL), i
        assert [t for t, _, _ in entry.top] == w[1], i
        assert all(a >= b for (_, _, a), (_, _, b) in zip(entry.top, entry.top[1:]))


@pytest.mark.parametrize("budget", [7, 64])
def test_prompt_logprobs_equal_the_logits_of_every_position_through_chunked_prefill(budget: int) -> None:
    engine, backend = make_engine(max_num_batched_tokens=budget, block_size=4)
    p = prompts(1, 40, 40, seed=1)[0]
    res = run(engine, {"a": (p, SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=3))})["a"]
    check(res["prompt_logprobs"], p, 3)
    assert res["tokens"] == reference_greedy(p, 5)  # the sampled row is still the chunk's last
    # every prefill chunk asked for a row per position; decode steps for one
    slices = [s for b in backend.batches for s in b.slices]
    prefill = [s for s in slices if s.start_pos < len(p)]
    assert sum(len(s.token_ids) for s in prefill) == len(p)
    assert all(s.num_logits == len(s.token_ids) for s in prefill)
    assert all(s.num_logits == 1 for s in slices if s.start_pos >= len(p))


def test_requests_without_prompt_logprobs_are_untouched_beside_one_with_them() -> None:
    engine, backend = make_engine(max_num_batched_tokens=16, block_size=4)
    ps = prompts(4, 5, 30, seed=2)
    requests = {f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0 if i == 1 else None))
                for i, p in enumerate(ps)}  # fmt: skip
    res = run(engine, requests)
    for i, p in enumerate(ps):
        assert res[f"r{i}"]["tokens"] == reference_greedy(p, 8), i
        if i == 1:
            check(res["r1"]["prompt_logprobs"], p, 0)
        else:
            assert res[f"r{i}"]["prompt_logprobs"] == []
    others = [s for b in backend.batches for s in b.slices if s.seq_id != 1]
    assert all(s.num_logits <= 1 for s in others)


def test_a_cached_prefix_is_computed_again_for_its_logits() -> None:
    engine, _ = make_engine(max_num_batched_tokens=64, block_size=4)
    p = prompts(1, 33, 33, seed=3)[0]
    run_to_completion_first = run(engine, {"warm": (p, SamplingParams(temperature=0.0, max_tokens=2))})
    assert run_to_completion_first["warm"]["tokens"] == reference_greedy(p, 2)
    hits = engine.stats().prefix_cache_hit_tokens
    res = run(engine, {"a": (p, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))})["a"]
    check(res["prompt_logprobs"], p, 1)
    assert engine.stats().prefix_cache_hit_tokens == hits  # nothing reused for it
    # and a request that wants none still reuses the cache
    run(engine, {"b": (p, SamplingParams(temperature=0.0, max_tokens=2))})
    assert engine.stats().prefix_cache_hit_tokens > hits


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_send_their_prompt_logprobs_once_and_right(mode: str) -> None:
    ps = prompts(6, 10, 30, seed=4)
    engine, _ = make_engine(num_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=12,
                            preemption_mode=mode, num_swap_blocks=64 if mode == "swap" else None)  # fmt: skip
    requests = {f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2))
                for i, p in enumerate(ps)}  # fmt: skip
    res = run(engine, requests)
    assert engine.stats().num_preemptions > 0
    for i, p in enumerate(ps):
        check(res[f"r{i}"]["prompt_logprobs"], p, 2)
        assert res[f"r{i}"]["tokens"] == reference_greedy(p, 12), i


def test_a_one_token_prompt_has_only_the_first_entry() -> None:
    engine, _ = make_engine()
    res = run(engine, {"a": ([7], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0))})["a"]
    assert res["prompt_logprobs"] == [(1, [None])]
    assert res["tokens"] == reference_greedy([7], 3)


def test_prompt_logprobs_are_checked() -> None:
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(prompt_logprobs=bad).validate(256)
        assert err.value.param == "prompt_logprobs"


def test_run_to_completion_still_agrees() -> None:
    """The testkit's loop sees the same tokens (the field is additive)."""
    engine, _ = make_engine(max_num_batched_tokens=8)
    p = prompts(1, 20, 20, seed=5)[0]
    engine.add_request("a", p, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0))
    assert run_to_completion(engine)["a"]["tokens"] == reference_greedy(p, 4)
