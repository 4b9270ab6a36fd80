"""Paged KV-cache bookkeeping: which physical blocks each sequence owns, and which it shares.

Pure Python; the backend holds the tensors, this only hands out integers.

Prefix caching: a *full* block whose KV has been computed is identified by a
hash of its tokens chained with the hash of the block before it (and, for the
first block, a salt: a tenant's own cache namespace), so equal hashes mean an
equal whole prefix. A new sequence reuses every cached block of its longest
cached prefix and skips that part of prefill. Blocks are reference counted;
when the last sequence lets go of a cached block it stays in the cache as
*evictable*, and is evicted (least recently released first) only when no
uncached free block is left. Only full blocks are shared, and no sequence
writes below its computed tokens, so a shared block is never written, with one
exception: a prompt that is cached to its very end still needs the logits of
its last token, so that token is run again, into a copy of its block
(copy-on-write; the copy is made by the backend before the step).

Swap: a preempted sequence may park the blocks holding its computed KV in swap
slots (host memory or disk, owned by the backend) instead of dropping them, and
get fresh blocks with that KV copied back when room returns. Copies and swaps
are logged in the order they are decided and the backend runs them in that
order before the next forward, so a block or slot given back by one operation
can be taken by a later one in the same step without a read-after-write race.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterable
from collections.abc import Sequence as Tokens
from typing import Literal

from .errors import BlockManagerError
from .sequence import Sequence

DEFAULT_BLOCK_SIZE = 16

# One KV operation for the backend: copy_blocks (src, dst), swap_out (block, slot), swap_in (slot, block).
KVOpKind = Literal["copy", "swap_out", "swap_in"]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` positions."""
    return -(-num_tokens // block_size)


def chain_hash(previous: bytes, tokens: Tokens[int]) -> bytes:
    """The hash of a full block: its tokens chained with the hash of the prefix before it."""
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return digest.digest()


def salt_hash(salt: str | None) -> bytes:
    """Where a sequence's chain starts: one namespace per salt (None: the shared one)."""
    return b"" if salt is None else hashlib.blake2b(salt.encode("utf-8"), digest_size=16, person=b"kv-salt").digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        enable_prefix_caching: bool = False,
        num_swap_slots: int = 0,
    ) -> None:
        if num_blocks < 1 or block_size < 1 or num_swap_slots < 0:
            raise BlockManagerError(
                f"need num_blocks >= 1, block_size >= 1 and num_swap_slots >= 0, "
                f"got {num_blocks}, {block_size}, {num_swap_slots}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Free blocks that hold nothing reusable; taken first. FIFO reuse spreads
        # writes over the cache instead of hammering block 0.
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        # Free blocks whose KV is cached, least recently released first: evicted in that order.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # chain hash -> the block holding that KV
        # Every copy (copy-on-write: source, destination) and swap owed before the
        # next forward, in the order decided. A copy's source keeps a reference
        # until ``copies_done``.
        self.pending_ops: list[tuple[KVOpKind, tuple[int, int]]] = []
        self.num_swap_slots = num_swap_slots
        self.free_swap_slots: deque[int] = deque(range(num_swap_slots))
        # Counters for metrics: prompt tokens looked up at admission, and found cached.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def kv_slots(self, seqs: Iterable[Sequence]) -> tuple[int, int]:
        """(used, allocated) token slots: positions of ``seqs`` holding computed KV, and
        the slots of every block in use (``num_used_blocks * block_size``).

        Their ratio is the cache's utilisation: what paging wastes is the unfilled
        tail of each sequence's last block, plus room taken for tokens not yet run
        (a draft, a prefill chunk). A block shared through the prefix cache counts
        once, however many tables name it.
        """
        bs = self.block_size
        filled: dict[int, int] = {}
        for seq in seqs:
            computed = seq.num_computed_tokens
            for i, block_id in enumerate(seq.block_table):
                n = min(bs, computed - i * bs)
                if n <= 0:
                    break
                if n > filled.get(block_id, 0):
                    filled[block_id] = n
        return sum(filled.values()), self.num_used_blocks * bs

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # -- admission: a sequence with no blocks gets room for all its known tokens

    def can_allocate(self, seq: Sequence) -> bool:
        return self._fits(seq, self._cached_prefix(seq))

    def _fits(self, seq: Sequence, hits: list[int]) -> bool:
        fresh = self.blocks_needed(seq.num_tokens) - len(hits) + self._copy_needed(seq, hits)
        # A hit on an evictable block takes it off the free lists too.
        reclaimed = sum(1 for b in hits if self.ref_counts[b] == 0)
        return fresh + reclaimed <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for every token it has (prompt + output so far), reusing its cached prefix.

        Sets ``seq.num_computed_tokens`` to the tokens whose KV it found cached.
        """
        if seq.block_table:
            raise BlockManagerError(f"allocate: {seq!r} already holds blocks")
        hits = self._cached_prefix(seq)
        if not self._fits(seq, hits):
            raise BlockManagerError(
                f"allocate: {seq!r} needs {self.blocks_needed(seq.num_tokens)} blocks, "
                f"only {self.num_free_blocks} free"
            )
        for block_id in hits:
            self._reuse_block(block_id)
        table = hits + [self._take_block() for _ in range(self.blocks_needed(seq.num_tokens) - len(hits))]
        computed = len(hits) * self.block_size
        if self._copy_needed(seq, hits):
            # Cached to the end: run the last token again, into a copy of its block.
            computed = seq.num_tokens - 1
            last = len(hits) - 1
            copy = self._take_block()
            self.pending_ops.append(("copy", (table[last], copy)))  # the source keeps its reference until copied
            table[last] = copy
        seq.block_table = table
        seq.num_computed_tokens = computed
        seq.num_committed_blocks = len(hits)
        if self.enable_prefix_caching:
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += computed

    def take_ops(self) -> list[tuple[KVOpKind, list[tuple[int, int]]]]:
        """The pending operations, consecutive ones of a kind merged into one call."""
        runs: list[tuple[KVOpKind, list[tuple[int, int]]]] = []
        for kind, pair in self.pending_ops:
            if runs and runs[-1][0] == kind:
                runs[-1][1].append(pair)
            else:
                runs.append((kind, [pair]))
        return runs

    @property
    def pending_copies(self) -> list[tuple[int, int]]:
        return [pair for kind, pair in self.pending_ops if kind == "copy"]

    def copies_done(self) -> None:
        """The backend has run the pending operations: release the copies' sources."""
        copies, self.pending_ops = self.pending_copies, []
        for src, _ in copies:
            self._release_block(src)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The blocks holding ``seq``'s longest cached prefix of full blocks (none while
        its prompt still needs logits: a cached block has none to give)."""
        if not self.enable_prefix_caching or seq.needs_prompt_logits:
            return []
        hits = []
        full = seq.num_tokens // self.block_size
        for h in self._hashes(seq, full)[:full]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _copy_needed(self, seq: Sequence, hits: list[int]) -> int:
        return 1 if hits and len(hits) * self.block_size >= seq.num_tokens else 0

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """``seq.block_hashes``, extended to hold at least its first ``num_blocks`` full blocks' chain hashes."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            previous = hashes[-1] if hashes else salt_hash(seq.cache_salt)
            hashes.append(chain_hash(previous, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    # -- growth: room for the next n tokens to be computed

    def _growth(self, seq: Sequence, num_new_tokens: int) -> int:
        covered = len(seq.block_table)
        return max(0, self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - covered)

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """Whether ``seq`` can compute ``num_new_tokens`` more tokens without eviction."""
        return self._growth(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Extend ``seq.block_table`` to cover positions up to
        ``num_computed_tokens + num_new_tokens - 1``."""
        growth = self._growth(seq, num_new_tokens)
        if growth > self.num_free_blocks:
            raise BlockManagerError(
                f"append_slots: {seq!r} needs {growth} more blocks, only {self.num_free_blocks} free"
            )
        seq.block_table.extend(self._take_block() for _ in range(growth))

    def trim(self, seq: Sequence) -> None:
        """Give back blocks past those ``seq``'s tokens need (a rejected draft's)."""
        keep = self.blocks_needed(seq.num_tokens)
        while len(seq.block_table) > keep:
            self._release_block(seq.block_table.pop())

    # -- after a step: full blocks whose KV is now computed join the cache

    def commit(self, seq: Sequence) -> None:
        """Cache every full block of ``seq`` whose KV is computed and not cached yet."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        hashes = self._hashes(seq, full)
        for i in range(seq.num_committed_blocks, full):
            block_id, h = seq.block_table[i], hashes[i]
            # An equal block computed twice (two sequences admitted in one step) is
            # cached once; the other copy stays private and is freed as usual.
            if self.block_hashes[block_id] is None and h not in self.cached:
                self.block_hashes[block_id] = h
                self.cached[h] = block_id
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)

    # -- swap

    @property
    def num_free_swap_slots(self) -> int:
        return len(self.free_swap_slots)

    def can_swap_out(self, seq: Sequence) -> bool:
        """Whether ``seq`` has computed KV and the free slots to park all of it."""
        return 0 < self.blocks_needed(seq.num_computed_tokens) <= len(self.free_swap_slots)

    def swap_out(self, seq: Sequence) -> None:
        """Park the blocks holding ``seq``'s computed KV in swap slots and free its table.

        Blocks past its computed tokens (room taken for a token or draft not run
        yet) are dropped, not parked.
        """
        if not self.can_swap_out(seq):
            raise BlockManagerError(
                f"swap_out: {seq!r} needs {self.blocks_needed(seq.num_computed_tokens)} swap slots, "
                f"{len(self.free_swap_slots)} free"
            )
        keep = self.blocks_needed(seq.num_computed_tokens)
        slots = [self.free_swap_slots.popleft() for _ in range(keep)]
        self._log("swap_out", zip(seq.block_table[:keep], slots))
        self.free(seq)
        seq.swap_slots = slots
        self.num_swapped_out_blocks += keep

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """Whether ``seq`` can come back and compute ``num_new_tokens`` more tokens."""
        return self.blocks_needed(seq.num_computed_tokens + num_new_tokens) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> None:
        """Give ``seq`` fresh blocks and bring its parked KV back into them."""
        if seq.block_table or not seq.swap_slots:
            raise BlockManagerError(f"swap_in: {seq!r} is not swapped out")
        if len(seq.swap_slots) > self.num_free_blocks:
            raise BlockManagerError(
                f"swap_in: {seq!r} needs {len(seq.swap_slots)} blocks, only {self.num_free_blocks} free"
            )
        table = [self._take_block() for _ in seq.swap_slots]
        self._log("swap_in", zip(seq.swap_slots, table))
        # A slot given back here may be reused by a later swap_out of this step:
        # the ordered log runs this read first.
        self.free_swap(seq)
        seq.block_table = table
        # Fresh blocks are outside the prefix cache; commit() registers them again.
        seq.num_committed_blocks = 0
        self.num_swapped_in_blocks += len(table)

    def free_swap(self, seq: Sequence) -> None:
        """Give back ``seq``'s swap slots (it came back in, or was aborted while out)."""
        self.free_swap_slots.extend(seq.swap_slots)
        seq.swap_slots = []

    def _log(self, kind: KVOpKind, pairs: Iterable[tuple[int, int]]) -> None:
        self.pending_ops.extend((kind, pair) for pair in pairs)

    # -- release

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody references go back to the free lists."""
        # Release in reverse so the tail blocks (least likely to be shared as a
        # prefix later) are the first to be evicted.
        for block_id in reversed(seq.block_table):
            self._release_block(block_id)
        seq.block_table = []
        seq.num_committed_blocks = 0

    def incref(self, block_id: int) -> None:
        """Another table now points at ``block_id``."""
        self._check_id(block_id)
        if self.ref_counts[block_id] == 0:
            raise BlockManagerError(f"incref of free block {block_id}")
        self.ref_counts[block_id] += 1

    def _take_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            self._uncache(block_id)
        else:
            raise BlockManagerError("no free KV block")
        if self.ref_counts[block_id] != 0:
            raise BlockManagerError(f"block {block_id} is on the free list with ref count {self.ref_counts[block_id]}")
        self.ref_counts[block_id] = 1
        return block_id

    def _reuse_block(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.evictable[block_id]
        self.ref_counts[block_id] += 1

    def _uncache(self, block_id: int) -> None:
        h = self.block_hashes[block_id]
        if h is not None:
            self.block_hashes[block_id] = None
            if self.cached.get(h) == block_id:
                del self.cached[h]

    def _release_block(self, block_id: int) -> None:
        self._check_id(block_id)
        if self.ref_counts[block_id] <= 0:
            raise BlockManagerError(f"double free of KV block {block_id}")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.block_hashes[block_id] is not None:
                self.evictable[block_id] = None
            else:
                self.free_block_ids.append(block_id)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise BlockManagerError(f"block id {block_id} out of range 0..{self.num_blocks - 1}")
