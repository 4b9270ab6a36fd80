"""Speculative decoding: cheap proposals that the target model verifies in one multi-token forward.

A decoding sequence runs ``[last token] + draft`` in one step and gets a logits
row for each; the sampler (``Sampler.verify_row``) accepts draft tokens while
they are what the target would have produced, by the rejection-sampling rule,
so the output distribution is exactly the target's (and greedy output is
token for token the same as plain decoding). After the first rejection the
rest of the draft, and its KV, are discarded.

``NgramProposer`` (prompt lookup) needs no model: it finds the longest recent
n-gram at the end of the sequence that occurred before, and proposes what
followed it then. It pays where output copies from the input (summaries,
edits, code, retrieval answers) and costs nothing where it finds no match.

``k`` adapts per sequence to what gets accepted; a sequence whose drafts keep
failing stops speculating for a while, and the scheduler speculates only while
the batch is small enough that extra tokens per sequence are cheap.

Imports no tensor library.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import EngineConfigError
from .sequence import Sequence

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    k: int = 4  # most draft tokens per step
    min_ngram: int = 1
    max_ngram: int = 4
    # Speculate only while at most this many sequences decode in a step: past
    # it the extra tokens make the step compute-bound and cost more than they save.
    max_batch: int = 8
    # Steps a sequence waits, after a draft was rejected outright at k = 1, before trying again.
    cooldown_steps: int = 16

    def check(self) -> None:
        if self.method not in METHODS:
            raise EngineConfigError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("k", "min_ngram", "max_ngram", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineConfigError(f"speculative {name} must be a positive integer, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise EngineConfigError("speculative min_ngram must not exceed max_ngram")
        if isinstance(self.cooldown_steps, bool) or not isinstance(self.cooldown_steps, int) or self.cooldown_steps < 0:
            raise EngineConfigError("speculative cooldown_steps must be a non-negative integer")


class SpecState:
    """One sequence's speculation: its n-gram index, its current k, and its cool-down."""

    __slots__ = ("index", "indexed", "k", "wait")

    def __init__(self, k: int) -> None:
        # (n-gram) -> start of its most recent occurrence that has a token after it.
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # tokens[:indexed] are in the index
        self.k = k
        self.wait = 0


class NgramProposer:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the sequence's tail."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``seq.token_ids`` (possibly none)."""
        state = self.state(seq)
        tokens = seq.token_ids
        self._index(state, tokens)
        for n in range(min(self.config.max_ngram, len(tokens) - 1), self.config.min_ngram - 1, -1):
            start = state.index.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []

    def state(self, seq: Sequence) -> SpecState:
        if seq.spec_state is None:
            seq.spec_state = SpecState(self.config.k)
        return seq.spec_state

    def _index(self, state: SpecState, tokens: list[int]) -> None:
        # Position j has a token after every n-gram that ends just before it.
        for j in range(max(state.indexed, 1), len(tokens)):
            for n in range(self.config.min_ngram, min(self.config.max_ngram, j) + 1):
                state.index[tuple(tokens[j - n : j])] = j - n
        state.indexed = len(tokens)


class Speculator:
    """What the scheduler asks (``draft``) and the engine tells (``observe``) about speculation."""

    def __init__(self, config: SpeculativeConfig) -> None:
        config.check()
        self.config = config
        self.proposer = NgramProposer(config)
        self.num_proposed = 0
        self.num_accepted = 0

    def draft(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Draft tokens for ``seq``'s next step, at most ``max_tokens`` (the step's room for it)."""
        wanted = seq.params.speculative_k
        if wanted == 0:  # the request turned speculation off
            return []
        state = self.proposer.state(seq)
        if state.wait:
            state.wait -= 1
            if state.wait == 0:
                state.k = 1
            return []
        # Never draft past the sequence's own end: those tokens could not be kept.
        k = min(state.k, max_tokens, seq.max_tokens - seq.num_output_tokens - 1)
        if wanted is not None:
            k = min(k, wanted)
        return self.proposer.propose(seq, k) if k > 0 else []

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """After verification: adapt ``seq``'s k to how much of its draft was accepted."""
        self.num_proposed += proposed
        self.num_accepted += accepted
        state = self.proposer.state(seq)
        if accepted == proposed:
            state.k = min(self.config.k, state.k + 1)
        elif accepted:
            state.k = accepted + 1
        elif state.k > 1:
            state.k //= 2
        else:
            state.wait = self.config.cooldown_steps
