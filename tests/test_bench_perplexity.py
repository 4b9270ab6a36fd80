"""The perplexity computation of benchmarks/bench_perplexity.py on distributions whose
perplexity is known in closed form (the model runs are the benchmark's, not a test's)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scripts import load_benchmark

ppl = load_benchmark("bench_perplexity")


def test_uniform_logits_give_the_vocabulary_size() -> None:
    vocab, ctx = 50, 8
    chunk = [3, 1, 4, 1, 5, 9, 2, 6]
    nll, count = ppl.score_chunk(np.full((ctx, vocab), 7.25, dtype=np.float32), chunk)
    assert count == ctx - 1 - ctx // 2  # positions 4..6 predict tokens 5..7
    assert ppl.perplexity(nll, count) == pytest.approx(vocab, rel=1e-9)


def test_only_the_second_half_is_scored_and_row_i_predicts_token_i_plus_1() -> None:
    vocab, ctx = 4, 6
    chunk = [0, 1, 2, 3, 0, 1]
    logits = np.zeros((ctx, vocab))
    # Rows 3 and 4 (the scored ones) give their next token probability p; rows 0..2 and 5
    # are wrong on purpose and must not count.
    p = 0.7
    rest = (1 - p) / (vocab - 1)
    for row in (3, 4):
        logits[row] = math.log(rest)
        logits[row, chunk[row + 1]] = math.log(p)
    logits[[0, 1, 2, 5]] = np.array([100.0, -100.0, -100.0, -100.0])
    nll, count = ppl.score_chunk(logits, chunk)
    assert count == 2
    assert ppl.perplexity(nll, count) == pytest.approx(1 / p, rel=1e-12)
    # Shifting the logits by a constant per row changes nothing (log-softmax), even far from 0.
    nll2, _ = ppl.score_chunk(logits + np.array([[1e4]] * ctx), chunk)
    assert nll2 == pytest.approx(nll, rel=1e-9)


def test_chunks_drop_the_tail_and_start_with_bos() -> None:
    tokens = list(range(10, 21))  # 11 tokens
    assert ppl.chunks(tokens, 4, None) == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert ppl.chunks(tokens, 4, 1) == [[1, 11, 12, 13], [1, 15, 16, 17]]
    assert ppl.chunks(tokens, 12, 1) == []
