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

``DraftModelProposer`` runs a smaller model with the target's vocabulary through
a backend of its own (a self-draft is the target's first N layers with its
final norm and head, sharing the weights) and proposes its greedy tokens. The
draft keeps its own paged KV per sequence, and keeps what is still valid
after verification: the KV of the tokens it fed that the target accepted.
Both proposers' drafts are deterministic, so the accept rule needs no draft
probabilities.

``k`` adapts per sequence to what gets accepted; a sequence whose drafts keep
failing stops speculating for a while, and the scheduler speculates only while
the batch is small enough that extra tokens per sequence are cheap.

Imports no tensor library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from inferflux.backends.base import Backend, BackendError, Batch, SequenceSlice

from .block_manager import BlockManager
from .errors import EngineConfigError
from .sequence import Sequence

METHODS = ("ngram", "draft")


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
    # method "draft": the draft model is the target's first ``draft_layers`` layers
    # (a self-draft), or a model of its own at ``draft_model`` (a path, loaded on
    # the target's backend kind by whoever builds the engine). One of the two.
    draft_layers: int | None = None
    draft_model: str | None = None

    def check(self) -> None:
        if self.method not in METHODS:
            raise EngineConfigError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "draft" and (self.draft_layers is None) == (self.draft_model is None):
            raise EngineConfigError("speculative method 'draft' needs draft_layers or draft_model (one of them)")
        if self.method == "ngram" and (self.draft_layers is not None or self.draft_model is not None):
            raise EngineConfigError("draft_layers and draft_model apply to speculative method 'draft' only")
        if self.draft_layers is not None and (
            isinstance(self.draft_layers, bool) or not isinstance(self.draft_layers, int) or self.draft_layers < 1
        ):
            raise EngineConfigError(f"speculative draft_layers must be a positive integer, got {self.draft_layers!r}")
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


class Proposer(Protocol):
    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to ``k`` draft tokens to follow each ``seq.token_ids`` (possibly none)."""

    def release(self, seq: Sequence) -> None:
        """``seq`` is finished or aborted: drop whatever is kept for it."""


class NgramProposer:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the sequence's tail."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.lookup(seq, k) for seq, k in wants]

    def release(self, seq: Sequence) -> None:
        pass

    def lookup(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``seq.token_ids`` (possibly none)."""
        state = spec_state(seq, self.config)
        tokens = seq.token_ids
        self._index(state, tokens)
        for n in range(min(self.config.max_ngram, len(tokens) - 1), self.config.min_ngram - 1, -1):
            start = state.index.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []

    def _index(self, state: SpecState, tokens: list[int]) -> None:
        # Position j has a token after every n-gram that ends just before it.
        for j in range(max(state.indexed, 1), len(tokens)):
            for n in range(self.config.min_ngram, min(self.config.max_ngram, j) + 1):
                state.index[tuple(tokens[j - n : j])] = j - n
        state.indexed = len(tokens)


def spec_state(seq: Sequence, config: SpeculativeConfig) -> SpecState:
    if seq.spec_state is None:
        seq.spec_state = SpecState(config.k)
    return seq.spec_state


class DraftModelProposer:
    """Greedy proposals of a draft model run through its own backend and paged KV.

    Each target sequence has a *shadow* sequence here: the tokens whose KV the
    draft holds. Before proposing, the shadow keeps the longest prefix it shares
    with the target's tokens (what verification accepted) and runs the rest in
    one multi-token forward; then it runs its own guesses one at a time. All
    sequences of a step draft together, one forward per draft position.
    """

    def __init__(self, config: SpeculativeConfig, backend: Backend, num_blocks: int, block_size: int) -> None:
        self.config = config
        self.backend = backend
        backend.allocate_kv(num_blocks, block_size)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.shadows: dict[int, Sequence] = {}  # target seq_id -> shadow

    def release(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in wants]
        wanted = {seq.seq_id for seq, _ in wants}
        active = [i for i, (seq, _) in enumerate(wants) if self._sync(seq, wanted)]
        while active:
            shadows = [self.shadows[wants[i][0].seq_id] for i in active]
            tokens = self._forward(shadows)
            still = []
            for i, shadow, token in zip(active, shadows, tokens):
                shadow.num_computed_tokens = shadow.num_tokens
                drafts[i].append(token)
                # The last guess is not run here: the target runs it, and so do we
                # next step if it is accepted.
                if len(drafts[i]) < wants[i][1] and self.block_manager.can_append(shadow, 1):
                    shadow.token_ids.append(token)
                    self.block_manager.append_slots(shadow, 1)
                    still.append(i)
            active = still
        return drafts

    def _sync(self, seq: Sequence, wanted: set[int]) -> bool:
        """Bring ``seq``'s shadow up to its tokens with room to run them; False where there is no room."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(seq.seq_id, seq.request_id, [], seq.params, max_tokens=seq.max_tokens)
            self.shadows[seq.seq_id] = shadow
        # The last token always runs again: its logits give the first guess.
        valid = _common_prefix(shadow.token_ids, seq.token_ids, min(shadow.num_computed_tokens, seq.num_tokens - 1))
        del shadow.token_ids[valid:]
        shadow.token_ids.extend(seq.token_ids[valid:])
        shadow.num_computed_tokens = valid
        self.block_manager.trim(shadow)
        new = shadow.num_tokens - valid
        if not self.block_manager.can_append(shadow, new):
            # Make room by dropping the KV of sequences not drafting this step.
            for seq_id in [s for s in self.shadows if s not in wanted]:
                self.block_manager.free(self.shadows.pop(seq_id))
            if not self.block_manager.can_append(shadow, new):
                return False
        self.block_manager.append_slots(shadow, new)
        return True

    def _forward(self, shadows: list[Sequence]) -> list[int]:
        slices = [
            SequenceSlice(
                seq_id=s.seq_id,
                token_ids=s.token_ids[s.num_computed_tokens :],
                start_pos=s.num_computed_tokens,
                block_table=tuple(s.block_table),
            )
            for s in shadows
        ]
        logits = np.asarray(self.backend.forward(Batch(slices, self.block_manager.block_size)))
        return [int(t) for t in logits.argmax(axis=-1)]


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of ``a[:limit]`` and ``b``."""
    n = min(limit, len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class Speculator:
    """What the scheduler asks (``draft``) and the engine tells (``observe``) about speculation.

    ``proposer`` defaults to the n-gram one; method "draft" needs a
    ``DraftModelProposer`` built by the engine (it owns a backend).
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        config.check()
        if proposer is None and config.method != "ngram":
            raise EngineConfigError(f"speculative method {config.method!r} needs its proposer")
        self.config = config
        self.proposer: Proposer = proposer or NgramProposer(config)
        self.num_proposed = 0
        self.num_accepted = 0

    def plan(self, seq: Sequence, max_tokens: int) -> int:
        """How many draft tokens ``seq`` should get this step (0: none), at most ``max_tokens``."""
        wanted = seq.params.speculative_k
        if wanted == 0:  # the request turned speculation off
            return 0
        state = spec_state(seq, self.config)
        if state.wait:
            state.wait -= 1
            if state.wait == 0:
                state.k = 1
            return 0
        # Never draft past the sequence's own end: those tokens could not be kept.
        k = min(state.k, max_tokens, seq.max_tokens - seq.num_output_tokens - 1)
        if wanted is not None:
            k = min(k, wanted)
        return max(k, 0)

    def draft(self, seqs: list[Sequence], max_tokens: int) -> list[list[int]]:
        """Draft tokens for each of ``seqs``' next step, at most ``max_tokens`` in all."""
        wants = []
        for seq in seqs:
            k = self.plan(seq, max_tokens)
            wants.append((seq, k))
            max_tokens -= k
        drafts = self.proposer.propose([w for w in wants if w[1] > 0])
        out = iter(drafts)
        return [next(out) if k > 0 else [] for _, k in wants]

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """After verification: adapt ``seq``'s k to how much of its draft was accepted."""
        self.num_proposed += proposed
        self.num_accepted += accepted
        state = spec_state(seq, self.config)
        if accepted == proposed:
            state.k = min(self.config.k, state.k + 1)
        elif accepted:
            state.k = accepted + 1
        elif state.k > 1:
            state.k //= 2
        else:
            state.wait = self.config.cooldown_steps


def make_speculator(spec: SpeculativeConfig | None, backend: Backend, draft_backend: Backend | None,
                    num_blocks: int, block_size: int) -> Speculator | None:  # fmt: skip
    """The engine's speculator for ``spec`` (None: no speculation). ``draft_backend``: the loaded
    draft model of a ``draft_model``; a self-draft (``draft_layers``) is cut from ``backend`` here.
    ``num_blocks`` and ``block_size``: the target's cache, which the draft's KV matches."""
    if spec is None:
        return None
    if spec.method != "draft":
        return Speculator(spec)
    if draft_backend is None:
        if spec.draft_layers is None:
            raise EngineConfigError(
                f"speculative draft_model {spec.draft_model!r} was not loaded: pass the loaded draft backend"
            )
        truncated = getattr(backend, "truncated", None)
        if truncated is None:
            raise EngineConfigError(f"{type(backend).__name__} cannot run a self-draft (draft_layers)")
        try:
            draft_backend = truncated(spec.draft_layers)
        except BackendError as exc:
            raise EngineConfigError(f"speculative draft_layers: {exc}") from exc
    # The draft keeps KV for as many tokens as the target can.
    return Speculator(spec, DraftModelProposer(spec, draft_backend, num_blocks, block_size))
