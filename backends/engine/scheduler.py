"""Continuous batching with chunked prefill and preemption by recompute or swap.

Every step mixes decodes of running sequences with prefill chunks, under a
token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``).
Order within a step:

1. decodes of running sequences, most important first; when a decode needs a
   block and none is free, the least important running sequence not yet
   scheduled in this step is preempted (possibly the one asking), of the most
   loaded tenant among equals;
2. next prefill chunks of running sequences whose prompt is not fully computed;
3. resumption of swapped-out sequences and admission of waiting ones, together,
   in fair order (below). A waiting sequence gets blocks for all its known
   tokens at admission, a swapped one at resumption (so a chunked prefill never
   stalls half-way, and step 2 needs no blocks), and a waiting one may
   preempt running sequences that are strictly less important than itself, or
   as important but of a tenant holding more than its fair share. This stops at
   the first sequence that does not fit, so a large request is not starved by
   small ones.

Fair sharing between tenants. Every sequence names its tenant (an opaque key,
``Sequence.tenant``) and that tenant's weight. A tenant's *load* is the number
of running sequences it holds (its seats in the batch, each one token per
decode step) divided by its weight. The next sequence to admit or resume is the
most important (lowest priority number) head of any tenant's queue; among
tenants at that priority, the head of the least loaded tenant; then the
earliest arrival. So one tenant's flood cannot queue another's requests behind
it, and tenants competing for the batch hold seats in proportion to their
weights (weighted max-min fairness over seats). When the batch is full, a
waiting sequence may take the seat of a running one of the same priority if its
tenant, seated, would still be no more loaded than the victim's tenant without
it, so seats move only from an over-share tenant to an under-share one and never
back and forth. Preemption for lack of blocks picks, among equally important
sequences, one of the most loaded tenant. With one tenant all of this is the
plain (priority, arrival) order.

Preemption frees the sequence's blocks. By recompute (the default) it goes back
to the waiting queue (ahead of later arrivals of its priority), and on
readmission its prompt and its output so far are prefilled again, except for
what the prefix cache still holds (``BlockManager``): admission starts a
sequence after its cached prefix. By swap (``preemption_mode="swap"``) its
computed KV is first parked in swap slots, and it resumes where it stopped once
blocks are free again; a sequence with nothing computed, or more than the free
slots hold, is recomputed instead.

A step's decision is a ``SchedulerOutput`` (``scheduler_output.py``): an entry
per sequence that runs, and the KV copies and swaps to run before the forward.
Imports no tensor library.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter
from collections.abc import Iterator

from .block_manager import BlockManager
from .errors import BlockManagerError
from .scheduler_output import ScheduledSeq, SchedulerOutput
from .sequence import Sequence, SequenceStatus
from .speculative import Speculator


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
        self.seats: Counter[str | None] = Counter()  # running sequences per tenant (no zero counts)
        # Waiting sequences per tenant: the gateway reads it from its own thread (one dict lookup,
        # atomic under the GIL) to keep one tenant from filling the whole queue.
        self.queued: Counter[str | None] = Counter()
        self._admissions = 0
        self._last_turn: dict[str | None, int] = {}  # tenant -> when it was last admitted (_admissions)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_key)
        self.queued[seq.tenant] += 1

    def _leave_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self.queued[seq.tenant] -= 1
        if not self.queued[seq.tenant]:
            del self.queued[seq.tenant]

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self._leave_running(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._leave_waiting(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.block_manager.free_swap(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.status = SequenceStatus.FINISHED_ABORTED

    # -- one step

    def schedule(self) -> SchedulerOutput:
        """One step's work, in the module docstring's order; each stage takes what budget the ones before left."""
        out = SchedulerOutput(block_size=self.block_manager.block_size)
        scheduled: dict[int, ScheduledSeq] = {}  # seq_id -> entry, insertion ordered
        budget = self._schedule_decodes(scheduled, out, self.max_num_batched_tokens)
        budget = self._schedule_prefill_chunks(scheduled, budget)
        self._schedule_admissions(scheduled, out, budget)
        out.scheduled = list(scheduled.values())
        out.kv_ops = self.block_manager.take_ops()
        return out

    def _schedule_decodes(self, scheduled: dict[int, ScheduledSeq], out: SchedulerOutput, budget: int) -> int:
        """1. decodes, preempting when blocks run out; then drafts where they fit as is. Returns the budget left."""
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
                scheduled[seq.seq_id] = ScheduledSeq.of(seq, 1)
                budget -= 1
                decoded.append(seq)
        if self.speculator is not None and len(decoding) <= self.speculator.config.max_batch and budget > 0:
            budget = self._add_drafts(self.speculator, decoded, scheduled, budget)
        return budget

    def _schedule_prefill_chunks(self, scheduled: dict[int, ScheduledSeq], budget: int) -> int:
        """2. next chunks of prefills already under way (their blocks came at admission). Returns the budget left."""
        for seq in self.running:
            if budget == 0:
                break
            if seq.seq_id in scheduled:
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            scheduled[seq.seq_id] = ScheduledSeq.of(seq, n)
            budget -= n
        return budget

    def _schedule_admissions(self, scheduled: dict[int, ScheduledSeq], out: SchedulerOutput, budget: int) -> None:
        """3. resumptions and admissions, in fair order, until one does not fit."""
        while (self.waiting or self.swapped) and budget > 0:
            seq = self._next_to_admit()
            if seq.status is SequenceStatus.SWAPPED:
                # Like an admission, room for all its known tokens: one swapped out half-way
                # through its prefill continues in step 2, which takes no blocks.
                rest = seq.num_uncomputed_tokens
                if len(self.running) >= self.max_num_seqs or not self.block_manager.can_swap_in(seq, rest):
                    break
                self.swapped.remove(seq)
                self.block_manager.swap_in(seq)
                self.block_manager.append_slots(seq, rest)
            else:
                if not self._make_room_for(seq, scheduled, out):
                    break
                for entry in [e for e in scheduled.values() if e.seq.status is not SequenceStatus.RUNNING]:
                    # a sequence scheduled above was preempted to make room: give back its budget
                    del scheduled[entry.seq.seq_id]
                    budget += entry.num_tokens
                self._leave_waiting(seq)
                self.block_manager.allocate(seq)
            self._join_running(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            scheduled[seq.seq_id] = ScheduledSeq.of(seq, n)
            budget -= n

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
                self._leave_running(seq)
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
            scheduled[seq.seq_id] = ScheduledSeq.of(seq, 1, draft)
            budget -= len(draft)
        return budget

    # -- fair sharing

    def _join_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        seq.admitted_at = seq.admitted_at or time.perf_counter()  # the first admission; a resumed one keeps it
        bisect.insort(self.running, seq, key=_key)
        self.seats[seq.tenant] += 1
        self._admissions += 1
        self._last_turn[seq.tenant] = self._admissions
        if len(self._last_turn) > MAX_REMEMBERED_TURNS:
            present = {s.tenant for s in (*self.running, *self.waiting, *self.swapped)}
            self._last_turn = {t: turn for t, turn in self._last_turn.items() if t in present}

    def _leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.seats[seq.tenant] -= 1
        if not self.seats[seq.tenant]:
            del self.seats[seq.tenant]  # bounded by the tenants with running sequences

    def _load(self, seq: Sequence, extra: int = 0) -> float:
        """How loaded ``seq``'s tenant is: its seats (plus ``extra``) for its weight."""
        return (self.seats[seq.tenant] + extra) / seq.weight

    def _next_to_admit(self) -> Sequence:
        """The waiting or swapped sequence to admit next: the most important
        head of a tenant's queue, of the least loaded tenant; among equally
        loaded ones the tenant whose turn was longest ago (round robin, which
        seats alone cannot tell when they are all taken), then the earliest."""
        top = min(_key(q[0]) for q in (self.waiting, self.swapped) if q)[0]
        heads: dict[str | None, Sequence] = {}
        for queue in (self.waiting, self.swapped):
            for seq in queue:
                if seq.priority != top:
                    break  # each queue is in priority order: nothing further can win
                head = heads.get(seq.tenant)
                if head is None or _key(seq) < _key(head):
                    heads[seq.tenant] = seq
        return min(heads.values(), key=lambda s: (self._load(s), self._last_turn.get(s.tenant, 0), s.arrival))

    # -- preemption

    def _pick_victim(self, scheduled: dict[int, ScheduledSeq]) -> Sequence:
        """The least important running sequence not yet scheduled in this step
        (the one asking for room qualifies); among those, one of the most
        loaded tenant, the most recently arrived."""
        candidates = [seq for seq in self.running if seq.seq_id not in scheduled]
        if not candidates:
            raise BlockManagerError("no running sequence left to preempt")
        return max(candidates, key=lambda s: (s.priority, self._load(s), s.arrival))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._leave_running(seq)
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
        """True when ``seq`` can be admitted now, after preempting running
        sequences that must yield to it (``_victims_for``) if that is enough to
        make it fit."""
        if self._fits(seq):
            return True
        victims = self._victims_for(seq)
        planned = self._enough_victims(seq, victims)
        if planned is None:
            return False  # evicting all that must yield would not be enough: evict nobody
        # The plan counts blocks as if none were shared or cached; should it fall
        # short, more of those that must yield follow.
        for victim in itertools.chain(planned, victims):
            self._preempt(victim, out)
            if self._fits(seq):
                return True
        # Only reachable once blocks are shared between tables (the count above
        # then overestimates what eviction frees); waiting a step is safe.
        return False

    def _victims_for(self, seq: Sequence) -> Iterator[Sequence]:
        """The running sequences that must yield to waiting ``seq``, in the order
        to preempt them: each time the least important, of the most loaded
        tenant, the latest. A sequence must yield if it is less important than
        ``seq``, or as important, of another tenant, and that tenant (less the
        seats of the victims before it) stays at least as loaded without it as
        ``seq``'s tenant with ``seq`` seated: seats move from an over-share
        tenant to an under-share one, never back and forth."""
        seats = Counter(self.seats)  # as the victims so far leave them

        def load(s: Sequence, extra: int = 0) -> float:
            return (seats[s.tenant] + extra) / s.weight

        candidates = [
            v for v in self.running
            if v.priority > seq.priority or (v.priority == seq.priority and v.tenant != seq.tenant)
        ]  # fmt: skip
        while True:
            eligible = [v for v in candidates if v.priority > seq.priority or load(seq, 1) <= load(v, -1)]
            if not eligible:
                return
            victim = max(eligible, key=lambda v: (v.priority, load(v), v.arrival))
            candidates.remove(victim)
            seats[victim.tenant] -= 1
            yield victim

    def _enough_victims(self, seq: Sequence, victims: Iterator[Sequence]) -> list[Sequence] | None:
        """The first ``victims`` whose blocks and seats would let ``seq`` fit; None if all would not."""
        blocks = self.block_manager.blocks_needed(seq.num_tokens) - self.block_manager.num_free_blocks
        seats = len(self.running) + 1 - self.max_num_seqs
        planned: list[Sequence] = []
        while blocks > 0 or seats > 0:
            victim = next(victims, None)
            if victim is None:
                return None
            planned.append(victim)
            blocks -= len(victim.block_table)
            seats -= 1
        return planned


PREEMPTION_MODES = ("recompute", "swap")
MAX_REMEMBERED_TURNS = 1024  # tenants whose last admission is kept; pruned to those with sequences


def _key(seq: Sequence) -> tuple[int, int]:
    return seq.sort_key
