"""Paged KV-cache bookkeeping: which physical blocks each sequence owns.

Pure Python; the backend holds the tensors, this only hands out integers.
Blocks carry reference counts so that prefix sharing (several block tables
pointing at one block) can be added without changing the free path.
"""

from __future__ import annotations

from collections import deque

from .errors import BlockManagerError
from .sequence import Sequence

DEFAULT_BLOCK_SIZE = 16


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` positions."""
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise BlockManagerError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        # FIFO reuse spreads writes over the cache instead of hammering block 0.
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # -- admission: a sequence with no blocks gets room for all its known tokens

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq.num_tokens) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for every token it has (prompt + output so far)."""
        if seq.block_table:
            raise BlockManagerError(f"allocate: {seq!r} already holds blocks")
        needed = self.blocks_needed(seq.num_tokens)
        if needed > len(self.free_block_ids):
            raise BlockManagerError(
                f"allocate: {seq!r} needs {needed} blocks, only {len(self.free_block_ids)} free"
            )
        seq.block_table = [self._take_block() for _ in range(needed)]

    # -- growth: room for the next n tokens to be computed

    def _growth(self, seq: Sequence, num_new_tokens: int) -> int:
        covered = len(seq.block_table)
        return max(0, self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - covered)

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """Whether ``seq`` can compute ``num_new_tokens`` more tokens without eviction."""
        return self._growth(seq, num_new_tokens) <= len(self.free_block_ids)

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Extend ``seq.block_table`` to cover positions up to
        ``num_computed_tokens + num_new_tokens - 1``."""
        growth = self._growth(seq, num_new_tokens)
        if growth > len(self.free_block_ids):
            raise BlockManagerError(
                f"append_slots: {seq!r} needs {growth} more blocks, only {len(self.free_block_ids)} free"
            )
        seq.block_table.extend(self._take_block() for _ in range(growth))

    # -- release

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody references go back to the free list."""
        # Release in reverse so the tail blocks (least likely to be shared as a
        # prefix later) are reused first.
        for block_id in reversed(seq.block_table):
            self._release_block(block_id)
        seq.block_table = []

    def incref(self, block_id: int) -> None:
        """Another table now points at ``block_id`` (prefix sharing)."""
        self._check_id(block_id)
        if self.ref_counts[block_id] == 0:
            raise BlockManagerError(f"incref of free block {block_id}")
        self.ref_counts[block_id] += 1

    def _take_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        if self.ref_counts[block_id] != 0:
            raise BlockManagerError(f"block {block_id} is on the free list with ref count {self.ref_counts[block_id]}")
        self.ref_counts[block_id] = 1
        return block_id

    def _release_block(self, block_id: int) -> None:
        self._check_id(block_id)
        if self.ref_counts[block_id] <= 0:
            raise BlockManagerError(f"double free of KV block {block_id}")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_block_ids.append(block_id)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise BlockManagerError(f"block id {block_id} out of range 0..{self.num_blocks - 1}")
