"""Scheduler alone (no backend): admission, budgets, preemption, priorities,
and random operation sequences checked against the bookkeeping invariants."""

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inferflux.backends.engine import BlockManager, SamplingParams, Scheduler, Sequence, SequenceStatus
from inferflux.backends.engine.block_manager import blocks_for

from engine_testkit import check_scheduler_invariants

_next_id = iter(range(10**9))


def new_seq(
    prompt_len: int, max_tokens: int = 100, priority: int = 0, tenant: str | None = None, weight: float = 1.0
) -> Sequence:
    i = next(_next_id)
    return Sequence(i, f"r{i}", [1] * prompt_len, SamplingParams(), max_tokens=max_tokens, priority=priority,
                    arrival=i, tenant=tenant, weight=weight)  # fmt: skip


def finish_step(sched: Scheduler, out, finish=()) -> None:
    """What the engine does after forward: append a token to every sampled
    sequence, mark some finished, then postprocess."""
    for s in out.sampled_seqs:
        s.append_token(5)
        if s in finish or s.num_output_tokens >= s.max_tokens:
            s.status = SequenceStatus.FINISHED_LENGTH
    sched.block_manager.copies_done()  # the backend ran out.kv_ops
    sched.postprocess(out)


def test_decodes_come_before_new_prefills_and_budget_is_respected():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = new_seq(3), new_seq(3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(e.seq, e.num_tokens, e.num_logits) for e in out.scheduled] == [(a, 3, 1), (b, 3, 1)]
    finish_step(sched, out)
    c = new_seq(30)
    sched.add(c)
    out = sched.schedule()
    # both decodes first, then a chunk of c with what is left of the budget
    assert [(e.seq, e.num_tokens) for e in out.scheduled] == [(a, 1), (b, 1), (c, 8)]
    assert out.scheduled[2].num_logits == 0 and out.num_tokens == 10
    finish_step(sched, out)
    out = sched.schedule()
    assert [(e.seq, e.start_pos, e.num_tokens) for e in out.scheduled] == [(a, 4, 1), (b, 4, 1), (c, 8, 8)]


def test_max_num_seqs_caps_the_running_set():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [new_seq(2) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [e.seq for e in out.scheduled] == seqs[:2]
    assert sched.waiting == [seqs[2]]


def test_preemption_picks_least_important_latest_and_requeues_in_front():
    # 4 blocks of 2 tokens; three 2-token prompts fill 3 blocks
    sched = Scheduler(BlockManager(4, 2), max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = new_seq(2), new_seq(2), new_seq(2)
    later = new_seq(1)
    for s in (a, b, c):
        sched.add(s)
    finish_step(sched, sched.schedule())
    sched.add(later)
    # each decode now needs a new block; only one is free: a gets it, then c
    # (latest) is evicted for b, and c itself cannot be served
    out = sched.schedule()
    assert [e.seq for e in out.scheduled] == [a, b]
    assert out.preempted == [c]
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert sched.waiting == [c, later]  # c arrived first: it goes back ahead of later
    assert sched.num_preemptions == 1 and c.num_preemptions == 1
    check_scheduler_invariants(sched, [a, b, c, later])
    finish_step(sched, out, finish=(a, b))
    # recompute: c is prefilled again, prompt and generated token together
    out = sched.schedule()
    assert (out.scheduled[0].seq, out.scheduled[0].start_pos, out.scheduled[0].num_tokens) == (c, 0, 3)


def test_priority_orders_admission_fifo_within_priority():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=1, max_num_batched_tokens=100)
    low1, high, low2, high2 = new_seq(2, priority=5), new_seq(2, priority=0), new_seq(2, priority=5), new_seq(2, priority=0)
    for s in (low1, high, low2, high2):
        sched.add(s)
    order = []
    while sched.has_unfinished():
        out = sched.schedule()
        order += [e.seq for e in out.scheduled if e.start_pos == 0]
        finish_step(sched, out, finish=[e.seq for e in out.scheduled])
    assert order == [high, high2, low1, low2]


def test_more_important_request_preempts_less_important_running():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=100)
    low = new_seq(12, priority=1)
    sched.add(low)
    finish_step(sched, sched.schedule())
    urgent = new_seq(8, priority=0)
    sched.add(urgent)
    out = sched.schedule()
    assert out.preempted == [low]
    assert [e.seq for e in out.scheduled] == [urgent]
    same = new_seq(16, priority=0)
    sched.add(same)
    out = sched.schedule()
    assert not out.preempted  # equal priority never evicts
    assert same in sched.waiting
    check_scheduler_invariants(sched, [low, urgent, same])


def test_large_waiting_request_is_not_starved_by_small_ones():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=100)
    small = new_seq(8)
    sched.add(small)
    finish_step(sched, sched.schedule())
    big = new_seq(12)
    tiny = new_seq(1)
    sched.add(big)
    sched.add(tiny)
    out = sched.schedule()
    assert [e.seq for e in out.scheduled] == [small]  # tiny would fit but waits behind big


# -- fair sharing between tenants


def seats_of(sched: Scheduler) -> dict[str | None, int]:
    return dict(Counter(s.tenant for s in sched.running))


class ClosedLoop:
    """Tenants' clients, each with one request in flight at a time, sending the next as soon as one ends."""

    def __init__(self, sched: Scheduler, clients: dict[str, int], weights: dict[str, float] | None = None,
                 prompt_len: int = 4, max_tokens: int = 8, priority: dict[str, int] | None = None) -> None:  # fmt: skip
        self.sched, self.weights, self.priority = sched, weights or {}, priority or {}
        self.prompt_len, self.max_tokens = prompt_len, max_tokens
        self.tokens: dict[str, int] = {t: 0 for t in clients}
        self.added_at: dict[int, int] = {}  # seq_id -> step it was sent
        self.waited: dict[str, list[int]] = {t: [] for t in clients}  # steps from sent to first scheduled
        self.steps = 0
        for tenant, n in clients.items():
            for _ in range(n):
                self.send(tenant)

    def send(self, tenant: str) -> Sequence:
        seq = new_seq(self.prompt_len, self.max_tokens, self.priority.get(tenant, 0), tenant,
                      self.weights.get(tenant, 1.0))  # fmt: skip
        self.added_at[seq.seq_id] = self.steps
        self.sched.add(seq)
        return seq

    def step(self) -> None:
        out = self.sched.schedule()
        self.seats = seats_of(self.sched)  # as the step ran
        for entry in out.scheduled:
            if entry.seq.seq_id in self.added_at and entry.seq.num_preemptions == 0:
                self.waited[entry.seq.tenant].append(self.steps - self.added_at.pop(entry.seq.seq_id))
        sampled = out.sampled_seqs
        finish_step(self.sched, out)
        self.steps += 1
        for seq in sampled:
            self.tokens[seq.tenant] += 1
            if seq.is_finished:
                self.send(seq.tenant)


def test_a_flood_from_one_tenant_does_not_queue_another_tenants_request():
    sched = Scheduler(BlockManager(400, 4), max_num_seqs=8, max_num_batched_tokens=200)
    load = ClosedLoop(sched, {"a": 32}, max_tokens=30)
    for _ in range(5):
        load.step()
    assert len(sched.running) == 8 and len(sched.waiting) == 24  # a holds every seat, and queues
    b = load.send("b")
    out = sched.schedule()
    # b is seated at once, in the seat of a's latest arrival; a's earlier requests keep waiting
    assert b in [e.seq for e in out.scheduled] and seats_of(sched) == {"a": 7, "b": 1}
    assert [v.tenant for v in out.preempted] == ["a"] and out.preempted[0].arrival == max(
        s.arrival for s in (*sched.running, *out.preempted) if s.tenant == "a"
    )
    check_scheduler_invariants(sched, [*sched.running, *sched.waiting])


def test_one_request_at_a_time_waits_at_most_a_step_behind_a_flood():
    sched = Scheduler(BlockManager(400, 4), max_num_seqs=8, max_num_batched_tokens=200)
    load = ClosedLoop(sched, {"a": 32, "b": 1}, max_tokens=20)
    for _ in range(300):
        load.step()
    assert len(load.waited["b"]) >= 10
    assert max(load.waited["b"]) <= 1  # FIFO would have queued each behind a's ~24 waiting requests
    assert load.tokens["a"] > 5 * load.tokens["b"]  # a keeps the rest of the batch
    # a seat moved from a to b once per b request, never back
    assert sched.num_preemptions <= len(load.waited["b"]) + 1


def test_tenants_take_turns_when_no_seat_can_move():
    # one seat: b cannot take a's (a would then be owed it back), but gets the next one before a's queue
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=1, max_num_batched_tokens=100)
    flood = [new_seq(2, max_tokens=3, tenant="a") for _ in range(4)]
    for s in flood:
        sched.add(s)
    finish_step(sched, sched.schedule())
    b = new_seq(2, max_tokens=3, tenant="b")
    sched.add(b)
    order = [flood[0]]
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.preempted
        order += [e.seq for e in out.scheduled if e.start_pos == 0]
        finish_step(sched, out)
    assert order == [flood[0], b, *flood[1:]]


def test_weights_give_proportional_shares_of_the_batch():
    sched = Scheduler(BlockManager(400, 4), max_num_seqs=8, max_num_batched_tokens=200)
    load = ClosedLoop(sched, {"a": 16, "b": 16}, weights={"a": 3.0, "b": 1.0}, max_tokens=10)
    for _ in range(50):
        load.step()
    assert load.seats == {"a": 6, "b": 2}
    start = dict(load.tokens)
    for _ in range(200):
        load.step()
    a, b = (load.tokens[t] - start[t] for t in ("a", "b"))
    assert 2.7 <= a / b <= 3.3


def test_equal_tenants_share_equally_and_seats_settle_without_preemptions():
    sched = Scheduler(BlockManager(400, 4), max_num_seqs=8, max_num_batched_tokens=200)
    load = ClosedLoop(sched, {"a": 30, "b": 3}, max_tokens=10)
    for _ in range(50):
        load.step()
    settled = sched.num_preemptions
    for _ in range(200):
        load.step()
    assert sched.num_preemptions == settled  # no seat ping-pong once shared
    assert load.seats == {"a": 5, "b": 3}  # b wants only 3 seats; a has the rest


def test_priority_still_ranks_across_tenants():
    sched = Scheduler(BlockManager(400, 4), max_num_seqs=4, max_num_batched_tokens=200)
    load = ClosedLoop(sched, {"a": 8, "b": 1}, priority={"b": 1}, max_tokens=10)
    for _ in range(60):
        load.step()
    assert load.tokens["b"] == 0  # b chose to be less important than a's whole flood
    assert sched.num_preemptions == 0


def test_blocks_running_out_preempt_the_most_loaded_tenant_first():
    # 4 blocks of 2 tokens; three 2-token prompts fill 3; then each decode needs a block and one is free
    sched = Scheduler(BlockManager(4, 2), max_num_seqs=8, max_num_batched_tokens=100)
    a1, a2, b = new_seq(2, tenant="a"), new_seq(2, tenant="a"), new_seq(2, tenant="b")
    for s in (a1, a2, b):
        sched.add(s)
    finish_step(sched, sched.schedule())
    out = sched.schedule()
    # a1 takes the free block; for a2 one must go: b arrived last, but a holds two seats to b's one
    assert out.preempted == [a2]
    assert [e.seq for e in out.scheduled] == [a1, b]
    check_scheduler_invariants(sched, [a1, a2, b])


class SchedulerMachine(RuleBasedStateMachine):
    """Random admit / step / finish / abort; invariants after every rule."""

    @initialize(
        num_blocks=st.integers(2, 24),
        block_size=st.sampled_from([1, 2, 4, 8]),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 24),
        swap_slots=st.none() | st.integers(1, 24),  # None: preemption by recompute
    )
    def setup(self, num_blocks, block_size, max_num_seqs, budget, swap_slots):
        mode = "recompute" if swap_slots is None else "swap"
        bm = BlockManager(num_blocks, block_size, num_swap_slots=swap_slots or 0)
        self.sched = Scheduler(bm, max_num_seqs, budget, preemption_mode=mode)
        self.seqs: list[Sequence] = []
        self.capacity = num_blocks * block_size

    @rule(
        prompt=st.integers(1, 40),
        max_tokens=st.integers(1, 20),
        priority=st.integers(0, 2),
        tenant=st.sampled_from([None, "a", "b"]),
    )
    def add(self, prompt, max_tokens, priority, tenant):
        # the engine rejects at add time anything that could never fit
        if blocks_for(prompt + max_tokens - 1, self.sched.block_manager.block_size) > self.sched.block_manager.num_blocks:
            return
        s = new_seq(prompt, max_tokens, priority, tenant, weight={"a": 2.0}.get(tenant, 1.0))
        self.sched.add(s)
        self.seqs.append(s)

    @rule(data=st.data())
    def step(self, data):
        before = {s.seq_id: s.num_uncomputed_tokens for s in self.sched.running}
        out = self.sched.schedule()
        self.check_batch(out, before)
        sampled = out.sampled_seqs
        finish = data.draw(st.lists(st.sampled_from(sampled), unique=True)) if sampled else []
        finish_step(self.sched, out, finish)

    @precondition(lambda self: any(not s.is_finished for s in self.seqs))
    @rule(data=st.data())
    def abort(self, data):
        s = data.draw(st.sampled_from([s for s in self.seqs if not s.is_finished]))
        self.sched.abort(s)

    def check_batch(self, out, decodes_before):
        bs = self.sched.block_manager.block_size
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        ids = [e.seq.seq_id for e in out.scheduled]
        assert len(ids) == len(set(ids))
        for e in out.scheduled:
            s = e.seq
            assert s.status is SequenceStatus.RUNNING
            assert e.start_pos == s.num_computed_tokens
            assert 1 <= e.num_tokens and e.start_pos + e.num_tokens <= s.num_tokens
            assert len(s.block_table) * bs >= e.start_pos + e.num_tokens
            assert e.num_logits == (1 if e.start_pos + e.num_tokens == s.num_tokens else 0)
        for sl, e in zip(out.batch().slices, out.scheduled):
            assert list(sl.token_ids) == e.seq.token_ids[e.start_pos : e.start_pos + e.num_tokens]
        # decodes first: a prefill chunk is only scheduled if every surviving decode was
        chunked = any(e.num_tokens > 1 for e in out.scheduled)
        scheduled = set(ids)
        skipped_decodes = [
            s for s in self.sched.running if decodes_before.get(s.seq_id) == 1 and s.seq_id not in scheduled
        ]
        assert not (chunked and skipped_decodes)

    @invariant()
    def books_balance(self):
        if hasattr(self, "sched"):
            check_scheduler_invariants(self.sched, self.seqs)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # liveness: everything left finishes in bounded steps
        for _ in range(5000):
            if not self.sched.has_unfinished():
                break
            before = {s.seq_id: s.num_uncomputed_tokens for s in self.sched.running}
            out = self.sched.schedule()
            assert not out.is_empty, "scheduler stalled with work pending"
            self.check_batch(out, before)
            finish_step(self.sched, out)
            check_scheduler_invariants(self.sched, self.seqs)
        assert not self.sched.has_unfinished()
        bm = self.sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert bm.num_free_swap_slots == bm.num_swap_slots
        assert all(s.is_finished for s in self.seqs)


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_state_machine = SchedulerMachine.TestCase
