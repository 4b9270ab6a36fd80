"""Speculative decoding (n-gram proposals): the same greedy tokens, the same sampling distribution.

The backend here copies like an induction head (``induction_logits``), so that
prompt-lookup drafts are often right, and computes every row from the context
it reads back through the block tables, so a draft's stale KV left in the cache
after a rejection would change later tokens.
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter

import numpy as np
import pytest

from inferflux.backends.engine import EngineConfigError, SamplingParams
from inferflux.backends.engine.speculative import NgramProposer, SpeculativeConfig

from engine_testkit import (
    VOCAB,
    PagedEchoBackend,
    check_scheduler_invariants,
    induction_logits,
    make_engine,
    reference_greedy,
)

COPYING = functools.partial(induction_logits, peak=8.0)


def copy_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts with repeated stretches, the kind of input that output copies from."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        words = [[r.randrange(1, VOCAB) for _ in range(r.randrange(2, 6))] for _ in range(6)]
        out.append([t for _ in range(r.randrange(4, 12)) for t in r.choice(words)])
    return out


def run(
    engine, requests: dict[str, tuple[list[int], SamplingParams]], stagger: int = 0, check: bool = True
) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    pending = list(requests.items())
    seqs = []
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and (stagger == 0 or steps % stagger == 0):
            rid, (prompt, params) = pending.pop(0)
            engine.add_request(rid, prompt, params)
            seqs.append(engine._requests[rid])
            if stagger == 0:
                continue
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        if check:
            check_scheduler_invariants(engine.scheduler, seqs)
        steps += 1
    return got


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_is_plain_greedy_token_for_token(k: int) -> None:
    prompts = copy_prompts(24, seed=k)
    requests = {}
    for i, prompt in enumerate(prompts):
        # Every third request opts out: batches mix speculative and plain sequences.
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                speculative_k=0 if i % 3 == 0 else None)  # fmt: skip
        requests[f"r{i}"] = (prompt, params)
    # Small enough that sequences are preempted and blocks of rejected drafts recycled.
    engine, _ = make_engine(block_size=4, num_blocks=80, max_num_seqs=8, max_num_batched_tokens=48,
                            speculative=SpeculativeConfig(k=k), logits_fn=COPYING)  # fmt: skip
    got = run(engine, requests, stagger=2)
    for rid, (prompt, params) in requests.items():
        assert got[rid] == reference_greedy(prompt, 24, eos=None, logits_fn=COPYING), rid
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_proposed_tokens > stats.spec_accepted_tokens
    assert stats.num_steps < sum(24 for _ in requests)  # fewer steps than tokens: drafts were kept
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats().num_blocks_used == 0


def test_drafts_cut_the_steps_of_a_copying_request() -> None:
    prompt = copy_prompts(1, seed=11)[0]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    steps = {}
    for name, spec in (("plain", None), ("speculative", SpeculativeConfig(k=4))):
        engine, _ = make_engine(block_size=4, num_blocks=128, speculative=spec, logits_fn=COPYING)
        out = run(engine, {"r": (prompt, params)})
        assert out["r"] == reference_greedy(prompt, 64, eos=None, logits_fn=COPYING)
        steps[name] = engine.stats().num_steps
    assert steps["speculative"] < steps["plain"] * 0.6


def test_stop_strings_and_max_tokens_cut_a_draft_short() -> None:
    prompt = [5, 6, 7, 8] * 10
    engine, _ = make_engine(speculative=SpeculativeConfig(k=8), logits_fn=COPYING)
    expected = reference_greedy(prompt, 11, eos=None, logits_fn=COPYING)
    got = run(engine, {"r": (prompt, SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True))})
    assert got["r"] == expected  # exactly max_tokens, not the rest of an accepted draft


def test_ngram_proposer_proposes_what_followed_the_tail_before() -> None:
    config = SpeculativeConfig(k=3, min_ngram=1, max_ngram=3)
    proposer = NgramProposer(config)
    from inferflux.backends.engine import Sequence

    seq = Sequence(0, "r", [1, 2, 3, 4, 9, 1, 2, 3], SamplingParams(), max_tokens=10)
    assert proposer.lookup(seq, 3) == [4, 9, 1]  # "1 2 3" occurred before, followed by 4 9 1
    seq.append_token(7)
    assert proposer.lookup(seq, 3) == []  # "7" never occurred before
    seq.append_token(2)
    assert proposer.lookup(seq, 2) == [3, 7]  # only "2" matches: its most recent earlier occurrence (6)
    # The index is incremental: a longer match appearing later wins.
    seq = Sequence(1, "s", [8, 8, 5, 8, 8, 6, 8, 8], SamplingParams(), max_tokens=10)
    assert proposer.lookup(seq, 1) == [6]


@pytest.mark.parametrize(
    "bad", [{"k": 0}, {"method": "medusa"}, {"min_ngram": 3, "max_ngram": 2}, {"max_batch": 0}, {"cooldown_steps": -1}]
)
def test_bad_speculative_configs_are_refused(bad: dict) -> None:
    with pytest.raises(EngineConfigError):
        make_engine(speculative=SpeculativeConfig(**bad))


def test_speculative_k_is_validated_per_request() -> None:
    engine, _ = make_engine(speculative=SpeculativeConfig())
    for bad in (-1, 17, True, 1.5):
        with pytest.raises(Exception, match="speculative_k"):
            engine.add_request("x", [1, 2], SamplingParams(speculative_k=bad))


# -- sampling: the distribution is the target's ----------------------------------------


SOFT = functools.partial(induction_logits, peak=6.0)  # copying about as likely as the echo peak


def exact_distributions(prompt: list[int], temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """The target's exact distribution of the first and of the second generated token."""

    def probs(ctx: list[int]) -> np.ndarray:
        row = SOFT(np.asarray(ctx)).astype(np.float64) / temperature
        p = np.exp(row - row.max())
        return p / p.sum()

    first = probs(prompt)
    second = sum(first[t] * probs(prompt + [t]) for t in range(VOCAB))
    return first, second


def chi_square_ok(counts: Counter, expected_p: np.ndarray, n: int) -> tuple[bool, float, float]:
    """Pearson's test at alpha = 0.001 (bins with expected < 5 pooled); Wilson-Hilferty critical value."""
    expected = expected_p * n
    big = expected >= 5
    observed = np.array([counts.get(t, 0) for t in range(VOCAB)], dtype=np.float64)
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.0902  # the 0.999 quantile of the standard normal
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical, stat, critical


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_distribution() -> None:
    # Every token occurs once in the prompt, so whatever the first token is, the
    # second token's step carries a one-token draft (what followed it in the
    # prompt), which the model accepts a fair share of the time. 3,000 seeded
    # runs per arm, each token's frequencies against the exact distribution.
    prompt = random.Random(5).sample(range(VOCAB), VOCAB)
    n, temperature = 3000, 1.0
    first, second = exact_distributions(prompt, temperature)
    arms = {}
    draft_model = SpeculativeConfig(method="draft", draft_model="soft-greedy", k=2, max_batch=64)
    arms_config = (("plain", None, None), ("ngram", SpeculativeConfig(k=2, max_batch=64), None),
                   ("draft-model", draft_model, PagedEchoBackend(logits_fn=SOFT)))  # fmt: skip
    for name, spec, draft_backend in arms_config:
        engine, _ = make_engine(num_blocks=8192, max_num_seqs=64, max_num_batched_tokens=4096,
                                speculative=spec, logits_fn=SOFT, draft_backend=draft_backend)  # fmt: skip
        requests = {f"s{i}": (prompt, SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seed=i))
                    for i in range(n)}  # fmt: skip
        arms[name] = run(engine, requests, check=False)
        if spec is not None:
            stats = engine.stats()
            assert stats.spec_proposed_tokens >= n  # the second token was drafted every time
            assert 0.1 * n < stats.spec_accepted_tokens < 0.9 * stats.spec_proposed_tokens  # both outcomes, often
    for name, got in arms.items():
        for position, dist in ((0, first), (1, second)):
            ok, stat, critical = chi_square_ok(Counter(t[position] for t in got.values()), dist, n)
            assert ok, f"{name}, token {position + 1}: chi-square {stat:.1f} >= {critical:.1f}"
