import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferflux.backends.engine import BlockManager, BlockManagerError, SamplingParams, Sequence

from engine_testkit import check_block_invariants


def seq(n_tokens: int, seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(range(1, n_tokens + 1)), SamplingParams(), max_tokens=1000)


def test_allocate_covers_all_tokens_and_free_returns_them():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq(9)
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 10
    check_block_invariants(bm, [s])


def test_append_slots_grows_only_at_block_boundaries():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq(4)
    bm.allocate(s)
    s.num_computed_tokens = 4
    s.append_token(7)  # position 4 starts block 2
    assert bm.can_append(s, 1)
    bm.append_slots(s, 1)
    assert len(s.block_table) == 2
    s.num_computed_tokens = 5
    s.append_token(8)
    bm.append_slots(s, 1)  # position 5: same block
    assert len(s.block_table) == 2
    bm.append_slots(s, 8)  # room for positions up to 12: four blocks
    assert len(s.block_table) == 4


def test_cannot_allocate_or_append_beyond_free():
    bm = BlockManager(num_blocks=2, block_size=4)
    big = seq(9)
    assert not bm.can_allocate(big)
    with pytest.raises(BlockManagerError):
        bm.allocate(big)
    s = seq(8)
    bm.allocate(s)
    s.num_computed_tokens = 8
    assert not bm.can_append(s, 1)
    with pytest.raises(BlockManagerError):
        bm.append_slots(s, 1)
    with pytest.raises(BlockManagerError, match="already holds"):
        bm.allocate(s)


def test_double_free_is_a_clear_error():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(5)
    bm.allocate(a)
    alias = seq(5, seq_id=1)
    alias.block_table = list(a.block_table)  # a bug: two owners without incref
    bm.free(a)
    with pytest.raises(BlockManagerError, match="double free"):
        bm.free(alias)


def test_ref_counts_support_sharing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(4)
    bm.allocate(a)
    b = seq(4, seq_id=1)
    b.block_table = list(a.block_table)
    bm.incref(a.block_table[0])
    a.num_computed_tokens = b.num_computed_tokens = 4  # a shared block is a computed one
    check_block_invariants(bm, [a, b])
    bm.free(a)
    assert bm.num_free_blocks == 3  # still held by b
    bm.free(b)
    assert bm.num_free_blocks == 4
    with pytest.raises(BlockManagerError):
        bm.incref(0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(1, 24),
    block_size=st.sampled_from([1, 2, 4, 16]),
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 7), st.integers(1, 40)),
        max_size=60,
    ),
)
def test_random_alloc_grow_free_keeps_books_balanced(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    live: dict[int, Sequence] = {}
    for op, key, n in ops:
        s = live.get(key)
        if op == "alloc" and s is None:
            s = seq(n, key)
            if bm.can_allocate(s):
                bm.allocate(s)
                live[key] = s
        elif op == "grow" and s is not None:
            s.num_computed_tokens = s.num_tokens
            if bm.can_append(s, n):
                bm.append_slots(s, n)
                s.token_ids.extend([1] * n)
                assert len(s.block_table) * block_size >= s.num_tokens
        elif op == "free" and s is not None:
            bm.free(s)
            del live[key]
        check_block_invariants(bm, live.values())
    for s in live.values():
        bm.free(s)
    assert bm.num_free_blocks == num_blocks


def test_kv_slots_count_computed_positions_over_blocks_in_use():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    assert bm.kv_slots([]) == (0, 0)
    a = seq(9)  # 3 blocks (12 slots), 9 positions computed
    bm.allocate(a)
    assert bm.kv_slots([a]) == (0, 12)  # nothing computed yet: allocated, all unused
    a.num_computed_tokens = 9
    assert bm.kv_slots([a]) == (9, 12)
    a.append_token(50)
    bm.append_slots(a, 5)  # room for a 5-token draft: positions 9..13, one more block
    assert bm.kv_slots([a]) == (9, 16)
    bm.commit(a)  # its two full blocks join the prefix cache
    # b shares a's two full blocks (8 slots, counted once) and computes 2 positions of its own.
    b = Sequence(1, "r1", list(range(1, 9)) + [77, 78], SamplingParams(), max_tokens=1000)
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8
    b.num_computed_tokens = 10
    used, allocated = bm.kv_slots([a, b])
    assert (used, allocated) == (9 + 2, 20)  # a's 9 + b's own tail 2; blocks: a's 4, b's 1
    bm.free(a)
    bm.free(b)
    assert bm.kv_slots([]) == (0, 0)
