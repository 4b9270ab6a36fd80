"""Prompt logprobs: how likely the model found each token of a prompt (the completions API's echo with logprobs).

A request asking for them (``SamplingParams.prompt_logprobs``) has its prefill
chunks run with a logits row for every position (``ScheduledSeq.prompt_logits``
of them before the chunk's sampled row, if it has one): the row of position
``p`` is the model's distribution over the token at ``p + 1``, read here as
log-softmax, once per prompt token. The first token has none (nothing came
before it), as in OpenAI's API. Such a sequence looks nothing up in the prefix
cache until its prompt is scored (``BlockManager``): a cached block has no
logits; a sequence recomputed after preemption scores only what it lacks.

The rows are the backend's raw logits: no penalty, bias or grammar applies to
a prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np

from .outputs import TokenLogprob


def score_rows(rows: np.ndarray, targets: Seq[int], top_n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each row's log-softmax at its target, and its ``top_n`` best ``(token_id, logprob)``, best first."""
    rows = np.asarray(rows, dtype=np.float32)
    best = rows.max(axis=1, keepdims=True)
    # float64 sums: a 49k-entry float32 sum loses the digits that 1e-3 agreement needs near zero
    lse = best[:, 0].astype(np.float64) + np.log(np.exp(rows - best).sum(axis=1, dtype=np.float64))
    picked = rows[np.arange(len(targets)), np.asarray(targets, dtype=np.int64)] - lse
    tops: list[list[tuple[int, float]]] = [[] for _ in targets]
    if top_n:
        n = min(top_n, rows.shape[1])
        cand = np.argpartition(-rows, n - 1, axis=1)[:, :n]
        for i, ids in enumerate(cand):
            ordered = ids[np.argsort(-rows[i, ids], kind="stable")]
            tops[i] = [(int(t), float(rows[i, t] - lse[i])) for t in ordered]
    return [(float(p), top) for p, top in zip(picked, tops)]


def prompt_rows(
    rows: np.ndarray, start_pos: int, token_ids: Seq[int], have: int, num_prompt_tokens: int
) -> tuple[np.ndarray, list[int]]:
    """Of a chunk's prompt rows (positions ``start_pos ..``), those that score prompt tokens not yet scored.

    ``have`` prompt tokens have their entry already (token 0's is None), so the
    next is token ``have``, read from position ``have - 1``. Returns the rows
    and the tokens they score.
    """
    lo = max(have - 1 - start_pos, 0)
    hi = min(len(rows), num_prompt_tokens - 1 - start_pos)
    if hi <= lo or have - 1 < start_pos:  # nothing new here (a gap cannot occur: chunks come in order)
        return rows[:0], []
    return rows[lo:hi], list(token_ids[start_pos + lo + 1 : start_pos + hi + 1])


def entries(
    scored: list[tuple[float, list[tuple[int, float]]]], targets: Seq[int], text_of: Callable[[int], str]
) -> list[TokenLogprob]:
    """``score_rows``' answers as the engine's ``TokenLogprob``s (``text_of``: a token id's text)."""
    return [
        TokenLogprob(t, text_of(t), logprob, [(alt, text_of(alt), lp) for alt, lp in top])
        for t, (logprob, top) in zip(targets, scored)
    ]
