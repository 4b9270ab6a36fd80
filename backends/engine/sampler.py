"""Token sampling over float32 logits rows, in numpy.

Per row, in this order (vLLM / Hugging Face order):

0. structured outputs: a guided sequence's grammar (``guided``) leaves every
   token it does not allow next at -inf, all guided rows of the batch masked
   in one call; a ``json_object`` near its ``max_tokens`` keeps room to close
   the object (``guided.Guide.limit``);
1. ``min_tokens``: eos (unless ``ignore_eos``) and ``stop_token_ids`` get -inf
   while the output is shorter than ``min_tokens`` (unless that would leave a
   guided row nothing: a grammar that can only end wins over min_tokens);
2. penalties: repetition (CTRL-style, over prompt + output tokens), then
   frequency and presence (over output tokens only); then ``logit_bias``,
   added to its tokens' logits (it never lifts a masked token: -inf stays);
3. greedy rows (``temperature == 0``) take the argmax, all in one call;
4. other rows: divide by temperature, keep the ``top_k`` best, then the
   smallest nucleus of mass ``top_p`` (renormalised over the top-k survivors),
   then drop tokens below ``min_p`` times the best token's probability, and
   draw one uniform number from the request's own ``numpy.random.Generator``.

Each sampled row draws exactly one number from its own generator, so a seeded
request produces the same tokens whatever else shares its batches, and across
preemption (the generator lives on the sequence).

Logprobs follow OpenAI's meaning, the model's own distribution: the
log-softmax of the logits after steps 0-2 (the grammar's and min_tokens'
masks, penalties, logit_bias), before temperature and truncation. So greedy
and sampled requests report the same numbers for the same context.

A batch with no guided row, no penalty, bias or min_tokens pays nothing for
any of them: two list comprehensions over its sequences' attributes.

Filtering never sorts the whole vocabulary: a threshold below the best logit
picks a small candidate set that is widened until it provably holds the answer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass

import numpy as np

from .guided import apply_bitmask, bitmask_words, fill_masks, mask_rows
from .sequence import Sequence

_SEED_MASK = (1 << 64) - 1
_DRAW_CHUNK = 1024  # two-level inverse-CDF draw: block sums, then one block
_INITIAL_WINDOW = 8.0  # logits within this of the best form the first candidate set


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprob: float | None = None  # of token_id; None unless params.logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # best first; None unless top_logprobs > 0


class Sampler:
    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)

    def sample(self, logits: object, seqs: Seq[Sequence]) -> list[SampleResult]:
        """One token for each row of ``logits`` ([len(seqs), vocab]); row i belongs to seqs[i]."""
        logits = np.asarray(logits, dtype=np.float32)
        if logits.ndim != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits shaped {logits.shape} do not match {len(seqs)} sequences")
        if not seqs:
            return []
        vocab = logits.shape[1]

        edit_rows = [
            i for i, seq in enumerate(seqs)
            if seq.params.has_penalties or seq.params.logit_bias or self._masks_stops(seq)
        ]  # fmt: skip
        guided_rows = [i for i, seq in enumerate(seqs) if seq.guide is not None]
        if guided_rows:
            bitmask = np.zeros((len(guided_rows), bitmask_words(vocab)), dtype=np.int32)
            fill_masks([(seqs[i].guide, j) for j, i in enumerate(guided_rows)], (), bitmask)
            if len(guided_rows) == len(seqs):
                logits = apply_bitmask(logits, bitmask)  # a new array: the backend's buffer is left alone
            else:
                logits = logits.copy()  # the backend may reuse its output buffer
                mask_rows(logits, guided_rows, bitmask)
            for i in guided_rows:
                if seqs[i].guide.closer is not None:  # json_object: keep room to close it
                    seqs[i].guide.limit(logits[i], seqs[i].max_tokens - seqs[i].num_output_tokens)
        elif edit_rows:
            logits = logits.copy()
        for i in edit_rows:
            self._apply_edits(logits[i], seqs[i], vocab)

        tokens = np.empty(len(seqs), dtype=np.int64)
        greedy = [i for i, seq in enumerate(seqs) if seq.params.greedy]
        if len(greedy) == len(seqs):
            tokens[:] = logits.argmax(axis=1)
        elif greedy:
            tokens[greedy] = logits[greedy].argmax(axis=1)

        rand = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if rand:
            inv_temp = np.array([1.0 / seqs[i].params.temperature for i in rand], dtype=np.float32)
            scaled = (logits if len(rand) == len(seqs) else logits[rand]) * inv_temp[:, None]
            for row, i in zip(scaled, rand):
                tokens[i] = _sample_row(row, seqs[i].params, _generator(seqs[i]))

        results = []
        for i, seq in enumerate(seqs):
            token = int(tokens[i])
            if seq.params.logprobs:
                results.append(_with_logprobs(logits[i], token, seq.params.top_logprobs))
            else:
                results.append(SampleResult(token))
        return results

    def draft_masks(self, seq: Sequence, draft: Seq[int], vocab: int) -> np.ndarray | None:
        """For a guided ``seq`` verifying ``draft``: the grammar's bitmask of each of its
        ``1 + len(draft)`` rows (after each prefix of the draft), the matcher left where it
        was; rows past a draft token the grammar refuses allow nothing (verification stops
        at that token anyway). None for a sequence without a grammar."""
        if seq.guide is None:
            return None
        bitmask = np.zeros((1 + len(draft), bitmask_words(vocab)), dtype=np.int32)
        if draft:
            fill_masks((), [(seq.guide, 0, draft)], bitmask)
        else:
            fill_masks([(seq.guide, 0)], (), bitmask)
        return bitmask

    def verify_row(
        self, logits_row: object, seq: Sequence, proposal: int | None, mask: np.ndarray | None = None
    ) -> tuple[SampleResult, bool]:
        """One row of a speculative step: the token ``seq`` gets, and whether it is ``proposal``.

        The row is processed as ``sample`` would (the grammar's ``mask``, a row of
        ``draft_masks``; min_tokens, penalties against ``seq``'s output so far,
        logit_bias, temperature, top-k/p, min-p): a draft token the grammar
        refuses is never kept. Greedy rows take
        the argmax, so a draft is kept exactly while it matches plain greedy
        decoding; sampled rows use the rejection rule of speculative sampling, so
        the tokens are distributed exactly as plain sampling's. ``proposal`` None:
        the bonus row after a fully accepted draft, sampled as usual.
        """
        row = np.array(logits_row, dtype=np.float32)  # a copy: edited below
        if mask is not None:
            row = apply_bitmask(row, mask)
            seq.guide.limit(row, seq.max_tokens - seq.num_output_tokens)
        self._apply_edits(row, seq, row.size)
        params = seq.params
        if params.greedy:
            token = int(row.argmax())
            took = token == proposal
        elif proposal is None:
            token, took = _sample_row(row / np.float32(params.temperature), params, _generator(seq)), False
        else:
            token, took = _verify_sampled(row / np.float32(params.temperature), params, _generator(seq), proposal)
        result = _with_logprobs(row, token, params.top_logprobs) if params.logprobs else SampleResult(token)
        return result, took

    def _masks_stops(self, seq: Sequence) -> bool:
        return seq.num_output_tokens < seq.params.min_tokens

    def _apply_edits(self, row: np.ndarray, seq: Sequence, vocab: int) -> None:
        """min_tokens, penalties and logit_bias, where the request has them."""
        self._apply_min_tokens(row, seq, vocab)
        if seq.params.has_penalties:
            _apply_penalties(row, seq)
        if seq.params.logit_bias:
            _apply_logit_bias(row, seq)

    def _apply_min_tokens(self, row: np.ndarray, seq: Sequence, vocab: int) -> None:
        if not self._masks_stops(seq):
            return
        banned = set(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            banned |= self.eos_token_ids
        ids = [t for t in banned if 0 <= t < vocab]
        if not ids:
            return
        if seq.guide is not None:
            finite = np.isfinite(row)
            if int(finite.sum()) <= int(finite[ids].sum()):
                return  # the grammar allows nothing but what min_tokens bans: it has to end here
        row[ids] = -np.inf


def _generator(seq: Sequence) -> np.random.Generator:
    if seq.generator is None:
        seed = seq.params.seed
        # Unseeded requests still get their own stream: their draws must not
        # shift a seeded neighbour's.
        seq.generator = np.random.default_rng(None if seed is None else seed & _SEED_MASK)
    return seq.generator


def _apply_penalties(row: np.ndarray, seq: Sequence) -> None:
    params = seq.params
    if params.repetition_penalty != 1.0:
        if seq.prompt_token_set is None:
            seq.prompt_token_set = np.unique(np.asarray(seq.prompt_token_ids, dtype=np.int64))
        ids = seq.prompt_token_set
        if seq.output_token_ids:
            ids = np.union1d(ids, np.asarray(seq.output_token_ids, dtype=np.int64))
        vals = row[ids]
        row[ids] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and seq.output_token_ids:
        ids, counts = np.unique(np.asarray(seq.output_token_ids, dtype=np.int64), return_counts=True)
        row[ids] -= (params.frequency_penalty * counts + params.presence_penalty).astype(np.float32)


def _apply_logit_bias(row: np.ndarray, seq: Sequence) -> None:
    arrays = seq.logit_bias_arrays
    if arrays is None:
        bias = seq.params.logit_bias or {}
        arrays = seq.logit_bias_arrays = (
            np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
            np.fromiter(bias.values(), dtype=np.float32, count=len(bias)),
        )
    row[arrays[0]] += arrays[1]  # the ids are a dict's keys: no repeats


def _sample_row(x: np.ndarray, params, rng: np.random.Generator) -> int:
    if not math.isfinite(float(x.max())):
        return int(np.argmax(x))  # everything masked (or NaN): nothing sensible to draw from
    ids, weights = _distribution(x, params)
    return _draw_full(weights, rng) if ids is None else int(ids[_draw(weights, rng)])


def _distribution(x: np.ndarray, params) -> tuple[np.ndarray | None, np.ndarray]:
    """What a draw is made from: (candidate ids, their unnormalised weights) after top-k,
    top-p and min-p; ids None means the whole vocabulary, weights indexed by token id.
    ``x`` is a finite-maximum row already divided by the temperature."""
    vocab = x.size
    best = float(x.max())
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    top_p = params.top_p
    floor = best + math.log(params.min_p) if params.min_p > 0 else -math.inf

    if not top_k and top_p >= 1.0:
        if params.min_p > 0:
            cand = np.flatnonzero(x >= floor)
            return cand, np.exp(x[cand] - best)
        return None, np.exp(x - best)

    cand, total = _candidates(x, best, top_k, top_p)  # sorted best first
    weights = np.exp(x[cand] - best)
    if top_k:
        total = float(weights.sum())  # top-p renormalises over the top-k survivors
    keep = len(cand)
    if top_p < 1.0:
        cdf = np.cumsum(weights, dtype=np.float64) / total
        keep = min(keep, int(np.searchsorted(cdf, top_p, side="left")) + 1)
    if floor > -math.inf:
        keep = min(keep, max(1, int(np.count_nonzero(x[cand[:keep]] >= floor))))
    return cand[:keep], weights[:keep]


def _verify_sampled(x: np.ndarray, params, rng: np.random.Generator, proposal: int) -> tuple[int, bool]:
    """Speculative sampling against a draft that proposed ``proposal`` with certainty.

    Accept it with probability p(proposal); otherwise draw from p with the
    proposal removed (the residual max(0, p - q), renormalised). The result is
    distributed exactly as a plain draw from p.
    """
    if not math.isfinite(float(x.max())):
        token = int(np.argmax(x))
        return token, token == proposal
    ids, weights = _distribution(x, params)
    total = float(weights.sum(dtype=np.float64))
    if ids is None:
        mass = float(weights[proposal]) if 0 <= proposal < weights.size else 0.0
    else:
        mass = float(weights[ids == proposal].sum())
    if rng.random() * total < mass:
        return proposal, True
    residual = weights.copy()
    if ids is None:
        if 0 <= proposal < residual.size:
            residual[proposal] = 0.0
        return _draw_full(residual, rng), False
    residual[ids == proposal] = 0.0
    return int(ids[_draw(residual, rng)]), False


def _candidates(x: np.ndarray, best: float, top_k: int, top_p: float) -> tuple[np.ndarray, float]:
    """Indices that hold the top-k set (or, without top-k, the top-p nucleus),
    sorted by logit descending; and the full-row softmax normaliser when it
    was needed (top-p without top-k)."""
    total = float(np.exp(x - best).sum(dtype=np.float64)) if not top_k else 0.0
    window = _INITIAL_WINDOW
    span = None  # distance from the best to the worst finite logit, once needed
    while True:
        cand = np.flatnonzero(x >= best - window)
        if top_k:
            if cand.size >= top_k:
                break
        elif float(np.exp(x[cand] - best).sum(dtype=np.float64)) >= top_p * total:
            break
        if span is None:
            span = best - float(np.min(x, where=np.isfinite(x), initial=best))
        if window > span:
            break  # every finite logit is in: -inf ones can never be chosen anyway
        window *= 2.0
    vals = x[cand]
    if top_k and cand.size > 4 * top_k:
        part = np.argpartition(-vals, top_k - 1)[:top_k]
        cand, vals = cand[part], vals[part]
    order = np.argsort(-vals, kind="stable")
    cand = cand[order]
    if top_k:
        cand = cand[:top_k]
    return cand, total


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """Index drawn with probability proportional to ``weights``."""
    cdf = np.cumsum(weights, dtype=np.float64)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(i, len(cdf) - 1)


def _draw_full(weights: np.ndarray, rng: np.random.Generator) -> int:
    """``_draw`` over a whole vocabulary without a full-length float64 cumsum."""
    n = weights.size
    nblocks = -(-n // _DRAW_CHUNK)
    padded = weights
    if n % _DRAW_CHUNK:
        padded = np.zeros(nblocks * _DRAW_CHUNK, dtype=weights.dtype)
        padded[:n] = weights
    block_sums = np.cumsum(padded.reshape(nblocks, _DRAW_CHUNK).sum(axis=1), dtype=np.float64)
    u = rng.random() * block_sums[-1]
    b = min(int(np.searchsorted(block_sums, u, side="right")), nblocks - 1)
    if b:
        u -= block_sums[b - 1]
    lo = b * _DRAW_CHUNK
    inner = np.cumsum(weights[lo : lo + _DRAW_CHUNK], dtype=np.float64)
    j = int(np.searchsorted(inner, u, side="right"))
    j = min(j, len(inner) - 1)
    # float rounding can land u past the block's own sum; step back onto a
    # token that has weight rather than returning a zero-probability one
    while j > 0 and weights[lo + j] == 0:
        j -= 1
    return lo + j


def _with_logprobs(row: np.ndarray, token: int, top_n: int) -> SampleResult:
    best = float(row.max())
    if not math.isfinite(best):
        return SampleResult(token, float("nan"), [] if top_n else None)
    lse = best + math.log(float(np.exp(row - best, dtype=np.float32).sum(dtype=np.float64)))
    logprob = float(row[token]) - lse
    top = None
    if top_n:
        n = min(top_n, row.size)
        cand, _ = _candidates(row, best, n, 1.0)
        top = [(int(t), float(row[t]) - lse) for t in cand]
    return SampleResult(token, logprob, top)
