"""MLXBackend: turns the engine's integer batch into MLX arrays and runs the model.

mlx is imported lazily so that discovering and probing this backend works on a
machine without it (the probe then says what to install). On Linux it runs on
mlx's CPU build; on Apple silicon the same code runs on the GPU through Metal.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import platform
import tempfile
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import numpy as np

from inferflux.backends.base import (
    Batch,
    BackendError,
    ModelInfo,
    ModelSpec,
    SequenceSlice,
    check_embed_args,
    choose_dtype,
)

if TYPE_CHECKING:
    import mlx.core as mx

    from inferflux.backends.mlx.model import DecodeGroup, StepMetadata, Transformer

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16")


def on_apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def resolve_dtype(name: str) -> str:
    # On Apple silicon bf16 halves the weight and KV traffic that bounds decode
    # (M2 and later also compute in it natively). mlx's CPU build gains nothing
    # from it: a bf16 gemm ran no faster than float32 here.
    return choose_dtype(name, "mlx", DTYPES, lambda: "bfloat16" if on_apple_silicon() else "float32")


class MLXBackend:
    name: ClassVar[str] = "mlx"

    @classmethod
    def probe(cls) -> str | None:
        if importlib.util.find_spec("mlx") is None:
            return "MLX is not installed (pip install 'inferflux[mlx]')"
        try:
            import mlx.core  # noqa: F401  # the wheel may lack a build for this platform
        except ImportError as exc:
            return f"MLX is installed but mlx.core does not import: {exc}"
        return None

    def __init__(self) -> None:
        import mlx.core as mx

        self._mx = mx
        self._local = threading.local()
        self.model: Transformer | None = None
        self.dtype_name = ""
        self.kv_caches: list[tuple[mx.array, mx.array]] = []
        self.block_size = 0
        self.num_blocks = 0
        self.swap: np.ndarray | None = None  # [slots, layers, 2, kv_heads, block_size, head_dim]

    @contextlib.contextmanager
    def _on_this_thread(self) -> Iterator[None]:
        """Run the enclosed mlx work on a stream of the calling thread.

        The engine loads a model on one thread and steps it on another. Since mlx
        0.31.2 a stream belongs to the thread that made it (using another thread's
        stream raises "There is no Stream(gpu, N) in current thread"), so each thread
        gets a stream of its own, and every method evaluates what it built before
        returning: no pending work ever crosses threads. (Only the CPU build runs
        here; the Metal path is untested.)
        """
        mx = self._mx
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            yield

    # -- loading -----------------------------------------------------------------

    def load(self, spec: ModelSpec) -> ModelInfo:
        from inferflux.backends.mlx.model import Transformer
        from inferflux.backends.models import ModelLoadError, open_model

        mx = self._mx
        if spec.deterministic:
            raise BackendError("deterministic mode runs on the cpu backend only, not on mlx")
        dtype_name = resolve_dtype(spec.dtype)
        try:
            source = open_model(spec.path)
        except ModelLoadError as exc:
            raise BackendError(f"cannot load {spec.path}: {exc}") from exc
        cfg = source.config
        try:
            with self._on_this_thread():
                model = Transformer(cfg, getattr(mx, dtype_name))
                model.load_weights(source.tensors())
        except (ValueError, ModelLoadError) as exc:
            raise BackendError(f"cannot load {spec.path}: {exc}") from exc
        finally:
            source.close()
        self.model = model
        self.dtype_name = dtype_name
        log.info("mlx backend: loaded %s (%s, %s, on %s)", spec.name, cfg.architecture, dtype_name,
                 mx.default_device())
        return cfg.model_info(spec.name, dtype_name)

    @property
    def _cfg(self):
        if self.model is None:
            raise BackendError("no model loaded: call load() first")
        return self.model.cfg

    # -- KV cache ----------------------------------------------------------------

    def kv_block_bytes(self, block_size: int) -> int:
        cfg = self._cfg
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * self.model.dtype.size

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        mx, cfg = self._mx, self._cfg
        if num_blocks < 1 or block_size < 1:
            raise BackendError(f"cannot allocate {num_blocks} KV blocks of {block_size} tokens")
        shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        self.kv_caches = []  # drop the old cache before the new one is made
        with self._on_this_thread():
            self.kv_caches = [(mx.zeros(shape, self.model.dtype), mx.zeros(shape, self.model.dtype))
                              for _ in range(cfg.num_layers)]
            mx.eval(self.kv_caches)
        self.block_size, self.num_blocks = block_size, num_blocks

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        mx = self._mx
        src = mx.array([self._block(p[0]) for p in pairs])
        dst = mx.array([self._block(p[1]) for p in pairs])
        with self._on_this_thread():
            for k_cache, v_cache in self.kv_caches:
                k_cache[:, dst] = k_cache[:, src]
                v_cache[:, dst] = v_cache[:, src]
            mx.eval(self.kv_caches)

    def _block(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise BackendError(f"KV block {block} is outside the cache ({self.num_blocks} blocks)")
        return block

    # -- swapping (preemption_mode "swap") ------------------------------------------
    #
    # On Apple silicon host and GPU share one unified memory, so a swap slot is
    # just another buffer and plain synchronous copies are all there is to do
    # (no pinned staging or copy stream as a discrete GPU needs). Slots are kept
    # slot-major in numpy, one contiguous run per block: in RAM, or in a memory-
    # mapped file under ``directory`` for the disk tier. numpy has no bfloat16, so
    # bf16 blocks are stored as their uint16 bit patterns.

    def allocate_swap(self, num_slots: int, block_size: int, directory: str | None) -> None:
        cfg = self._cfg
        if not self.kv_caches or block_size != self.block_size:
            raise BackendError("allocate_swap needs allocate_kv first, with the same block size")
        if num_slots < 1:
            raise BackendError(f"cannot allocate {num_slots} swap slots")
        shape = (num_slots, cfg.num_layers, 2, cfg.num_kv_heads, block_size, cfg.head_dim)
        dtype = np.float32 if self.dtype_name == "float32" else np.uint16
        self.swap = None
        if directory is None:
            self.swap = np.zeros(shape, dtype=dtype)
        else:
            try:
                # Already unlinked: the space goes back when the mapping does.
                backing = tempfile.TemporaryFile(prefix="inferflux-mlx-swap-", dir=directory)
                self.swap = np.memmap(backing, dtype=dtype, mode="w+", shape=shape)
            except OSError as exc:
                raise BackendError(f"cannot create the swap file under {directory}: {exc}") from exc

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy KV block ``block`` into swap slot ``slot`` for each ``(block, slot)``."""
        if not pairs:
            return
        mx, swap = self._mx, self._swap_area()
        blocks = mx.array([self._block(b) for b, _ in pairs])
        slots = [self._slot(s) for _, s in pairs]
        with self._on_this_thread():
            # [layers, 2, kv_heads, n, block_size, dim] -> one [layers, 2, kv_heads, block_size, dim] per block
            data = mx.stack([mx.stack((k[:, blocks], v[:, blocks])) for k, v in self.kv_caches])
            data = data.transpose(3, 0, 1, 2, 4, 5)
            if self.dtype_name != "float32":
                data = data.view(mx.uint16)
            swap[slots] = np.asarray(data)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy swap slot ``slot`` back into KV block ``block`` for each ``(slot, block)``."""
        if not pairs:
            return
        mx, swap = self._mx, self._swap_area()
        slots = [self._slot(s) for s, _ in pairs]
        blocks = mx.array([self._block(b) for _, b in pairs])
        with self._on_this_thread():
            data = mx.array(swap[slots])  # [n, layers, 2, kv_heads, block_size, dim]
            if self.dtype_name != "float32":
                data = data.view(self.model.dtype)
            data = data.transpose(1, 2, 3, 0, 4, 5)  # [layers, 2, kv_heads, n, block_size, dim]
            for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
                k_cache[:, blocks] = data[layer, 0]
                v_cache[:, blocks] = data[layer, 1]
            mx.eval(self.kv_caches)

    def _swap_area(self) -> np.ndarray:
        if self.swap is None:
            raise BackendError("swap_out/swap_in called before allocate_swap()")
        return self.swap

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < len(self._swap_area()):
            raise BackendError(f"swap slot {slot} is outside the swap area ({len(self._swap_area())} slots)")
        return slot

    # -- the step ----------------------------------------------------------------

    def forward(self, batch: Batch) -> Any:
        mx = self._mx
        if self.model is None or not self.kv_caches:
            raise BackendError("forward called before load() and allocate_kv()")
        if batch.block_size != self.block_size:
            raise BackendError(f"batch block size {batch.block_size} != cache block size {self.block_size}")
        if not batch.slices:
            return np.zeros((0, self._cfg.vocab_size), dtype=np.float32)
        ids, meta, logits_rows = self._prepare(batch)
        with self._on_this_thread():
            logits = self.model(ids, meta, self.kv_caches, logits_rows)
            # Evaluate the caches too: a fresh prefill's attention does not read them, and
            # an unevaluated write would otherwise chain into the next step's graph.
            mx.eval(logits, self.kv_caches)
        return np.array(logits)

    # -- embeddings (backends.base: the optional embed) ---------------------------

    def embed(self, token_lists: Sequence[Sequence[int]], pooling: str) -> Any:
        """Each token list's pooled final hidden states, float32 ``[n, hidden]``, run without the KV cache."""
        from inferflux.backends.mlx.model import PrefillGroup, StepMetadata

        mx = self._mx
        check_embed_args(self.model is not None, token_lists, pooling)
        lengths = np.array([len(tokens) for tokens in token_lists])
        ends = np.cumsum(lengths)
        prefills = [PrefillGroup(int(end - n), int(end), None, None) for n, end in zip(lengths, ends)]
        positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
        empty = mx.array(np.zeros(0, dtype=np.int64))  # no cache slots: nothing is written
        meta = StepMetadata(positions=mx.array(positions), slot_blocks=empty, slot_offsets=empty, decode=None,
                            prefills=prefills, row_order=None)  # fmt: skip
        ids = mx.array([t for tokens in token_lists for t in tokens], dtype=mx.int32)
        with self._on_this_thread():
            # "last" needs one row a sequence through the final norm; "mean" all of them.
            rows = mx.array(ends - 1) if pooling == "last" else None
            h = self.model.hidden_states(ids, meta, None, rows).astype(mx.float32)
            if pooling == "mean":
                h = mx.stack([h[int(end - n) : int(end)].mean(axis=0) for n, end in zip(lengths, ends)])
            mx.eval(h)
        return np.array(h)

    def _prepare(self, batch: Batch) -> tuple[mx.array, StepMetadata, mx.array]:
        """Flatten the batch: token ids, cache slots, positions and attention groups."""
        from inferflux.backends.mlx.model import PrefillGroup, StepMetadata

        mx, bs = self._mx, batch.block_size
        ids: list[int] = []
        positions: list[np.ndarray] = []
        logits_rows: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[np.ndarray] = []
        decode_lens: list[int] = []
        prefill_rows: list[int] = []
        prefills: list[PrefillGroup] = []
        tables: list[np.ndarray] = []
        for s in batch.slices:
            n, start = len(s.token_ids), len(ids)
            end_pos = s.start_pos + n
            table = self._checked_table(s, bs)
            used = len(table)
            ids.extend(s.token_ids)
            positions.append(np.arange(s.start_pos, end_pos))
            tables.append(table)
            logits_rows.extend(range(start + n - s.num_logits, start + n))
            if n == 1:
                decode_rows.append(start)
                decode_tables.append(table)
                decode_lens.append(end_pos)
                continue
            prefill_rows.extend(range(start, start + n))
            if s.start_pos == 0:
                prefills.append(PrefillGroup(start, start + n, None, None))
            else:
                q_pos = np.arange(s.start_pos, end_pos)
                visible = np.arange(used * bs)[None, :] <= q_pos[:, None]  # causal, and below end_pos
                prefills.append(PrefillGroup(start, start + n, mx.array(table), mx.array(visible[None, None])))

        pos = np.concatenate(positions)
        slot_blocks = np.concatenate([t[p // bs] for t, p in zip(tables, positions)])
        decode = self._decode_group(decode_rows, decode_tables, decode_lens, len(ids), bs) if decode_rows else None
        order = np.asarray(decode_rows + prefill_rows)
        row_order = None
        if (order != np.arange(len(ids))).any():
            row_order = mx.array(np.argsort(order))  # group-ordered outputs back into batch rows
        meta = StepMetadata(
            positions=mx.array(pos.astype(np.int32)),
            slot_blocks=mx.array(slot_blocks),
            slot_offsets=mx.array(pos % bs),
            decode=decode,
            prefills=prefills,
            row_order=row_order,
        )
        return mx.array(ids, dtype=mx.int32), meta, mx.array(logits_rows, dtype=mx.int32)

    def _checked_table(self, s: SequenceSlice, bs: int) -> np.ndarray:
        """The blocks of ``s``'s table that hold its positions up to its last new token, each checked."""
        n, end_pos = len(s.token_ids), s.start_pos + len(s.token_ids)
        if n < 1 or not 0 <= s.num_logits <= n or s.start_pos < 0:
            raise BackendError(f"bad slice for sequence {s.seq_id}: {n} tokens from {s.start_pos}, "
                               f"{s.num_logits} logits")
        table = np.asarray(s.block_table, dtype=np.int64)
        used = (end_pos + bs - 1) // bs
        if len(table) < used or table[:used].min() < 0 or table[:used].max() >= self.num_blocks:
            raise BackendError(f"block table of sequence {s.seq_id} does not cover positions "
                               f"0..{end_pos - 1} with valid blocks")
        return table[:used]

    def _decode_group(self, rows: list[int], tables: list[np.ndarray], lens: list[int], num_rows: int,
                      bs: int) -> DecodeGroup:  # fmt: skip
        """The single-token rows as one group: their tables padded to the longest, what each may see."""
        from inferflux.backends.mlx.model import DecodeGroup

        mx = self._mx
        max_blocks = max(len(t) for t in tables)
        padded = np.zeros((len(tables), max_blocks), dtype=np.int64)
        for row, t in zip(padded, tables):
            row[: len(t)] = t
        visible = np.arange(max_blocks * bs)[None, :] < np.asarray(lens)[:, None]
        index = None if len(rows) == num_rows else mx.array(rows)
        return DecodeGroup(index, mx.array(padded), mx.array(visible[:, None, None]),
                           mx.array(np.asarray(lens, dtype=np.int32)))
