"""What one step of the scheduler decides: the tokens each sequence runs, and the KV copies before them.

``Scheduler.schedule`` returns a ``SchedulerOutput``; the engine runs its KV
operations, hands its ``batch()`` to the backend, samples a token for each
sequence that owns a logits row (``sampled_seqs``) and gives it back to
``Scheduler.postprocess``. Imports no tensor library.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferflux.backends.base import Batch, SequenceSlice

from .block_manager import KVOpKind
from .sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """``num_tokens`` tokens of ``seq`` starting at ``start_pos`` run this step.

    A speculative decode runs the sequence's last token and then ``draft``
    (tokens proposed, not yet the sequence's), with a logits row for each.
    A prefill chunk of a sequence that wants prompt logprobs has a row for
    each position: its first ``prompt_logits`` rows score the prompt
    (``prompt_logprobs``), and the last is sampled when the chunk reaches the end.
    """

    seq: Sequence
    start_pos: int
    num_tokens: int
    num_logits: int  # 1 when the chunk reaches the end of the known tokens, else 0; 1 + len(draft) with a draft
    draft: tuple[int, ...] = ()
    prompt_logits: int = 0  # of num_logits, the leading rows that score the prompt and are not sampled

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int, draft: list[int] | None = None) -> ScheduledSeq:
        """The next ``num_tokens`` of ``seq`` (after its computed ones), with the logits rows they need."""
        start = seq.num_computed_tokens
        if draft:
            return cls(seq, start, num_tokens + len(draft), 1 + len(draft), tuple(draft))
        reaches_end = start + num_tokens == seq.num_tokens
        if seq.needs_prompt_logits:  # a row for every position, the last sampled if the chunk reaches the end
            prompt_rows = num_tokens - 1 if reaches_end else num_tokens
            return cls(seq, start, num_tokens, num_tokens, prompt_logits=prompt_rows)
        return cls(seq=seq, start_pos=start, num_tokens=num_tokens, num_logits=1 if reaches_end else 0)

    @property
    def samples(self) -> bool:
        """Whether a token is sampled (or a draft verified) from this entry's rows."""
        return self.num_logits > self.prompt_logits

    @property
    def token_ids(self) -> tuple[int, ...]:
        known = self.seq.token_ids[self.start_pos : self.start_pos + self.num_tokens - len(self.draft)]
        return (*known, *self.draft)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_size: int = 16
    # Copies (copy-on-write of a cached block) and swaps for the backend to run, in
    # this order, before the forward: BlockManager.take_ops().
    kv_ops: list[tuple[KVOpKind, list[tuple[int, int]]]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def sampled_seqs(self) -> list[Sequence]:
        """Sequences owning a logits row, in row order."""
        return [s.seq for s in self.scheduled if s.samples]

    def batch(self) -> Batch:
        slices = [
            SequenceSlice(
                seq_id=s.seq.seq_id,
                token_ids=s.token_ids,
                start_pos=s.start_pos,
                block_table=tuple(s.seq.block_table),
                num_logits=s.num_logits,
            )
            for s in self.scheduled
        ]
        return Batch(slices=slices, block_size=self.block_size)
