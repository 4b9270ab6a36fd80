"""Continuous batching with chunked prefill and preemption by recompute or swap.

Every step mixes decodes of running sequences with prefill chunks, under a
token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``).
Order within a step:

1. decodes of running sequences, most important first; when a decode needs a
   block and none is free, the least important running sequence not yet
   scheduled in this step is preempted (possibly the one asking);
2. next prefill chunks of running sequences whose prompt is not fully computed;
3. resumption of swapped-out sequences and admission of waiting ones, together
   in (priority, arrival) order. A waiting sequence gets blocks for all its known
   tokens at admission (so a chunked prefill never stalls half-way), and may
   preempt running sequences that are strictly less important than itself. This
   stops at the first sequence that does not fit, so a large request is not
   starved by small ones.

Preemption frees the sequence's blocks. By recompute (the default) it goes back
to the waiting queue (ahead of later arrivals of its priority), and on
readmission its prompt and its output so far are prefilled again, except for
what the prefix cache still holds (``BlockManager``): admission starts a
sequence after its cached prefix. By swap (``preemption_mode="swap"``) its
computed KV is first parked in swap slots, and it resumes where it stopped once
blocks are free again; a sequence with nothing computed, or more than the free
slots hold, is recomputed instead. Imports no tensor library.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from backends.base import Batch, SequenceSlice

from .block_manager import BlockManager, KVOpKind
from .errors import BlockManagerError
from .sequence import Sequence, SequenceStatus
from .speculative import Speculator


@dataclass(frozen=True)
class ScheduledSeq:
    """``num_tokens`` tokens of ``seq`` starting at ``start_pos`` run this step.

    A speculative decode runs the sequence's last token and then ``draft``
    (tokens proposed, not yet the sequence's), with a logits row for each.
    """

    seq: Sequence
    start_pos: int
    num_tokens: int
    num_logits: int  # 1 when the chunk reaches the end of the known tokens, else 0; 1 + len(draft) with a draft
    draft: tuple[int, ...] = ()

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
        return [s.seq for s in self.scheduled if s.num_logits]

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


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        speculator: Speculator | None = None,
        preemption_mode: str = "recompute",
    ) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {preemption_mode!r}")
        self.block_manager = block_manager
        self.preemption_mode = preemption_mode
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.speculator = speculator
        # Both lists stay sorted by Sequence.sort_key (most important first).
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swap_outs = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_key)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.block_manager.free_swap(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.status = SequenceStatus.FINISHED_ABORTED

    # -- one step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(block_size=self.block_manager.block_size)
        scheduled: dict[int, ScheduledSeq] = {}  # seq_id -> entry, insertion ordered
        budget = self.max_num_batched_tokens

        # 1. decodes, with preemption when blocks run out; then drafts where they fit as is
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        decoded: list[Sequence] = []
        for seq in decoding:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            while not self.block_manager.can_append(seq, 1):
                victim = self._pick_victim(scheduled)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.append_slots(seq, 1)
                scheduled[seq.seq_id] = _entry(seq, 1)
                budget -= 1
                decoded.append(seq)
        if self.speculator is not None and len(decoding) <= self.speculator.config.max_batch and budget > 0:
            budget = self._add_drafts(self.speculator, decoded, scheduled, budget)

        # 2. next chunks of prefills already under way
        for seq in self.running:
            if budget == 0:
                break
            if seq.seq_id in scheduled:
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            scheduled[seq.seq_id] = _entry(seq, n)
            budget -= n

        # 3. resumptions and admissions, most important first
        while (self.waiting or self.swapped) and budget > 0:
            if self.swapped and (not self.waiting or _key(self.swapped[0]) < _key(self.waiting[0])):
                seq = self.swapped[0]
                n = min(seq.num_uncomputed_tokens, budget)
                if len(self.running) >= self.max_num_seqs or not self.block_manager.can_swap_in(seq, n):
                    break
                self.swapped.pop(0)
                self.block_manager.swap_in(seq)
                self.block_manager.append_slots(seq, n)
            else:
                seq = self.waiting[0]
                if not self._make_room_for(seq, scheduled, out):
                    break
                for entry in [e for e in scheduled.values() if e.seq.status is not SequenceStatus.RUNNING]:
                    # a sequence scheduled above was preempted to make room: give back its budget
                    del scheduled[entry.seq.seq_id]
                    budget += entry.num_tokens
                self.waiting.pop(0)
                self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_key)
            n = min(seq.num_uncomputed_tokens, budget)
            scheduled[seq.seq_id] = _entry(seq, n)
            budget -= n

        out.scheduled = list(scheduled.values())
        out.kv_ops = self.block_manager.take_ops()
        return out

    def postprocess(self, out: SchedulerOutput) -> list[Sequence]:
        """Record that the scheduled tokens are in the KV cache, and release
        sequences that finished (the engine sets their status). Returns them."""
        finished = []
        for entry in out.scheduled:
            seq = entry.seq
            if seq.status is SequenceStatus.WAITING or seq.status is SequenceStatus.SWAPPED:
                continue  # preempted after scheduling: nothing to record
            seq.num_computed_tokens = entry.start_pos + entry.num_tokens
            if entry.draft:
                # Only the accepted part of the draft is the sequence's; the KV written
                # for the rest is stale and its blocks go back (the rollback).
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
                self.block_manager.trim(seq)
            self.block_manager.commit(seq)
            if seq.is_finished and seq.status is not SequenceStatus.FINISHED_ABORTED:
                self.running.remove(seq)
                self.block_manager.free(seq)
                if self.speculator is not None:
                    self.speculator.release(seq)
                finished.append(seq)
        return finished

    # -- speculation

    def _add_drafts(
        self, speculator: Speculator, seqs: list[Sequence], scheduled: dict[int, ScheduledSeq], budget: int
    ) -> int:
        """Give decoding ``seqs`` draft tokens to verify where blocks allow; returns the budget left."""
        for seq, draft in zip(seqs, speculator.draft(seqs, budget)):
            draft = draft[:budget]
            if not draft or not self.block_manager.can_append(seq, 1 + len(draft)):
                continue  # no preemption for a guess
            self.block_manager.append_slots(seq, 1 + len(draft))
            scheduled[seq.seq_id] = _entry(seq, 1, draft)
            budget -= len(draft)
        return budget

    # -- preemption

    def _pick_victim(self, scheduled: dict[int, ScheduledSeq]) -> Sequence:
        """The least important, most recently arrived running sequence not yet
        scheduled in this step (the one asking for room qualifies)."""
        for seq in reversed(self.running):
            if seq.seq_id not in scheduled:
                return seq
        raise BlockManagerError("no running sequence left to preempt")

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        if self.preemption_mode == "swap" and self.block_manager.can_swap_out(seq):
            self.block_manager.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_key)
            self.num_swap_outs += 1
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        self.add(seq)

    def _fits(self, seq: Sequence) -> bool:
        return len(self.running) < self.max_num_seqs and self.block_manager.can_allocate(seq)

    def _make_room_for(self, seq: Sequence, scheduled: dict[int, ScheduledSeq], out: SchedulerOutput) -> bool:
        """True when ``seq`` can be admitted now, after preempting strictly less
        important running sequences if that is enough to make it fit."""
        if self._fits(seq):
            return True
        victims = [v for v in reversed(self.running) if v.priority > seq.priority]
        if not victims:
            return False
        reclaimable = self.block_manager.num_free_blocks + sum(len(v.block_table) for v in victims)
        if (
            self.block_manager.blocks_needed(seq.num_tokens) > reclaimable
            or len(self.running) - len(victims) >= self.max_num_seqs
        ):
            return False  # evicting them all would not be enough: evict nobody
        for victim in victims:
            self._preempt(victim, out)
            if self._fits(seq):
                return True
        # Only reachable once blocks are shared between tables (the count above
        # then overestimates what eviction frees); waiting a step is safe.
        return False


PREEMPTION_MODES = ("recompute", "swap")


def _key(seq: Sequence) -> tuple[int, int]:
    return seq.sort_key


def _entry(seq: Sequence, num_tokens: int, draft: list[int] | None = None) -> ScheduledSeq:
    start = seq.num_computed_tokens
    if draft:
        return ScheduledSeq(seq, start, num_tokens + len(draft), 1 + len(draft), tuple(draft))
    reaches_end = start + num_tokens == seq.num_tokens
    return ScheduledSeq(seq=seq, start_pos=start, num_tokens=num_tokens, num_logits=1 if reaches_end else 0)
