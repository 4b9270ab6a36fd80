"""The accelerator runner: the CPU backend's model and batching on any torch device.

``DeviceRunner`` is ``CPUBackend`` with three things made parameters: the device
the weights and the paged KV cache live on, the dtype chosen for ``auto``, and the
*kernel set* the model runs (``kernels.triton`` on CUDA/ROCm, ``kernels.metal`` on
Apple GPUs, ``kernels.reference`` or the Triton kernels under the interpreter for
tests on the CPU). A batch is still flattened on the host (``CPUBackend._prepare``)
and its few small index tensors are copied over; logits come back to the host as
float32 for the engine's sampler.

``CUDABackend`` adds CUDA graphs for decode-only steps (``DecodeGraphs``) and swaps
preempted sequences' blocks to pinned host memory without waiting for the copy
(``DeviceSwap``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Sequence, TypeVar

from inferflux.backends.base import Batch, BackendError, choose_dtype
from inferflux.backends.cpu.backend import CPUBackend, resolve_dtype
from inferflux.kernels.errors import KernelError

if TYPE_CHECKING:
    import torch

    from inferflux.backends.cpu.model import AttentionMetadata, Transformer

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "float16", "bfloat16")
# Decode batches are padded up to one of these sizes, each with its own graph.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
GRAPHS_ENV = "INFERFLUX_CUDA_GRAPHS"  # "0" runs every step eagerly

_D = TypeVar("_D")


def graph_batch_size(n: int, sizes: Sequence[int] = GRAPH_BATCH_SIZES) -> int | None:
    """The captured size a decode step of ``n`` sequences is padded to; None past the largest."""
    if n < 1:
        return None
    return next((size for size in sorted(sizes) if n <= size), None)


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first index, count, first slot)`` per run of consecutive slots: one copy per run, not per block."""
    runs: list[list[int]] = []
    for i, slot in enumerate(slots):
        if runs and slot == runs[-1][2] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([i, 1, slot])
    return [(first, count, slot) for first, count, slot in runs]


def tensors_to(obj: _D, device: torch.device) -> _D:
    """A copy of the dataclass ``obj`` with each tensor field on ``device``."""
    import torch

    # Asynchronous only on CUDA, whose copies from pageable memory return once the
    # source has been staged; elsewhere (mps) the host tensor could go before the copy.
    asynchronous = device.type == "cuda"
    moved = {
        f.name: value.to(device, non_blocking=asynchronous)
        for f in dataclasses.fields(obj)  # type: ignore[arg-type]
        if isinstance(value := getattr(obj, f.name), torch.Tensor)
    }
    return dataclasses.replace(obj, **moved)  # type: ignore[type-var]


class DeviceRunner(CPUBackend):
    """The shared Transformer on ``device`` running the kernel set ``kernels``."""

    # The accelerators' kernels are tiled and measured (docs/backends.md) for 16-token blocks,
    # and their memory is rarely what limits a batch: not the cpu backend's 8.
    default_block_size: ClassVar[int] = 16

    def __init__(self, device: str, kernels: ModuleType, num_threads: int | None = None) -> None:
        from inferflux.kernels import reference

        super().__init__(num_threads)
        self.device = self._torch.device(device)
        if kernels is reference and self.device.type != "cpu":
            # Its masks are built with host tensors (kernels.reference.context_mask).
            raise BackendError(f"the reference kernels run on the cpu device only, not {self.device}")
        self.kernels = kernels

    # -- hooks into CPUBackend.load -------------------------------------------------

    def _resolve_dtype(self, name: str) -> str:  # type: ignore[override]
        return choose_dtype(name, self.name, DTYPES, self._auto_dtype)

    def _auto_dtype(self) -> str:
        return resolve_dtype("auto")  # on the cpu device: bf16 where the CPU multiplies it natively

    def _use_kernels(self, model: Transformer) -> str | None:  # type: ignore[override]
        from inferflux.kernels import reference

        model.use_kernels(self.kernels)
        # Not None makes _prepare build the reference's decode mask once a step.
        return "the reference kernel set is in use" if self.kernels is reference else None

    def _attention_name(self) -> str:
        return self.kernels.__name__

    # -- the step -------------------------------------------------------------------

    def _prepare(self, batch: Batch, to_device: bool = True) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        ids, meta, logits_index = super()._prepare(batch)
        if not to_device:
            return ids, meta, logits_index
        ids, meta, moved = self._on_device(ids, meta, logits_index)
        return ids, meta, moved  # type: ignore[return-value]  # a tensor in, a tensor out

    def _on_device(
        self, ids: torch.Tensor, meta: AttentionMetadata, index: torch.Tensor | None
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        if self.device.type == "cpu":
            return ids, meta, index
        meta = dataclasses.replace(meta, prefills=[tensors_to(p, self.device) for p in meta.prefills])
        moved = None if index is None else index.to(self.device)
        return ids.to(self.device), tensors_to(meta, self.device), moved

    def forward(self, batch: Batch) -> Any:
        with self._kernel_errors():
            return super().forward(batch).cpu()  # the engine samples on the host

    def embed(self, token_lists: Sequence[Sequence[int]], pooling: str) -> Any:
        with self._kernel_errors():
            return super().embed(token_lists, pooling)

    @contextlib.contextmanager
    def _kernel_errors(self) -> Iterator[None]:
        """Where a step crosses into the kernel set, its ``KernelError`` is the backend's ``BackendError``."""
        try:
            yield
        except KernelError as exc:
            raise BackendError(f"{self.name} backend, {self.kernels.__name__}: {exc}",
                               {"kernels": self.kernels.__name__}) from exc

    # -- swap (backends.base) ---------------------------------------------------------

    def allocate_swap(self, num_slots: int, block_size: int, directory: str | None) -> None:
        if directory is not None:  # the disk tier: CPUBackend's swap file, written off the step loop
            super().allocate_swap(num_slots, block_size, directory)
            return
        if not self.kv_caches or block_size != self.block_size:
            raise BackendError("allocate_swap needs allocate_kv first, with the same block size")
        if self.swap is not None:
            self.swap.close()
        self.swap = DeviceSwap(num_slots, self.kv_caches)  # type: ignore[assignment]

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        if isinstance(self.swap, DeviceSwap):
            self.swap.swap_out(self.kv_caches, pairs)
        else:
            super().swap_out(pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        if isinstance(self.swap, DeviceSwap):
            self.swap.swap_in(self.kv_caches, pairs)
        else:
            super().swap_in(pairs)


class DeviceSwap:
    """Swap slots in host memory for a KV cache on a device.

    A slot holds one block of every layer, ``[2 * layers, kv_heads, block_size,
    head_dim]`` (K then V of layer 0, then of layer 1, ...).

    On CUDA the slots are pinned and ``swap_out`` does not wait for the host copy.
    It first gathers the blocks into a staging tensor on the device, on the
    compute stream: a device-to-device copy at memory speed, and every later use of
    the blocks (a forward, ``copy_blocks``, ``swap_in``) is queued after it on that
    same stream, so the blocks may be overwritten as soon as ``swap_out`` returns.
    A side stream then copies staging to the slots over PCIe, overlapping the next
    steps, and records an event that ``swap_in`` of those slots makes the compute
    stream wait for. The alternative, a synchronous copy into pinned memory, would
    stall the step loop for the whole PCIe transfer. ``record_stream`` keeps the
    staging memory from being reused until the side stream is done with it.
    Elsewhere (cpu, mps) the copies are plain synchronous ones.
    """

    def __init__(self, num_slots: int, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        import torch

        k0 = kv_caches[0][0]
        kv_heads, _, block_size, head_dim = k0.shape
        self.device = k0.device
        self.num_slots = num_slots
        self.slot_shape = (2 * len(kv_caches), kv_heads, block_size, head_dim)
        cuda = self.device.type == "cuda"
        try:
            self.store = torch.empty((num_slots, *self.slot_shape), dtype=k0.dtype, pin_memory=cuda)
        except RuntimeError as exc:
            raise BackendError(f"cannot allocate {num_slots} swap slots in host memory: {exc}") from exc
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.pending: dict[int, Any] = {}  # slot -> torch.cuda.Event of the copy that fills it

    def swap_out(
        self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], pairs: Sequence[tuple[int, int]]
    ) -> None:
        import torch

        if not pairs:
            return
        from inferflux.backends.cpu.swap import stack_blocks

        slots = self._checked([slot for _, slot in pairs])
        staging = stack_blocks(kv_caches, [block for block, _ in pairs])
        if self.stream is None:
            self._copy_runs(slots, staging, to_host=True)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._copy_runs(slots, staging, to_host=True)
            done = torch.cuda.Event()
            done.record()
        staging.record_stream(self.stream)
        for slot in slots:
            self.pending[slot] = done

    def swap_in(
        self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], pairs: Sequence[tuple[int, int]]
    ) -> None:
        import torch

        if not pairs:
            return
        slots = self._checked([slot for slot, _ in pairs])
        if self.stream is not None:
            compute = torch.cuda.current_stream(self.device)
            for event in {id(e): e for s in slots if (e := self.pending.pop(s, None)) is not None}.values():
                compute.wait_event(event)  # the device waits, not the host
        from inferflux.backends.cpu.swap import unstack_blocks

        staging = torch.empty((len(slots), *self.slot_shape), dtype=self.store.dtype, device=self.device)
        self._copy_runs(slots, staging, to_host=False)
        unstack_blocks(kv_caches, [block for _, block in pairs], staging)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self.pending.clear()

    def _copy_runs(self, slots: Sequence[int], staging: torch.Tensor, to_host: bool) -> None:
        for first, count, slot in slot_runs(slots):
            host, dev = self.store[slot : slot + count], staging[first : first + count]
            dst, src = (host, dev) if to_host else (dev, host)
            dst.copy_(src, non_blocking=self.stream is not None)

    def _checked(self, slots: list[int]) -> list[int]:
        bad = [s for s in slots if not 0 <= s < self.num_slots]
        if bad:
            raise BackendError(f"swap slots {bad} out of range 0..{self.num_slots - 1}")
        return slots


class DecodeGraphs:
    """CUDA graphs of decode-only steps, one per batch size, over static input buffers.

    A step of ``n`` sequences is copied into the first ``n`` rows of the buffers and
    padded to the next captured size; padded rows run token 0 at position 0 of
    ``scratch_block``, a KV block no sequence owns, so they write only there. The
    block-table buffer is ``width`` blocks wide for every size, the longest context
    a sequence can have, so one graph serves every context length (the kernels read
    a row's table only up to its context length).

    Before ``capture`` (or where it is impossible: no CUDA), ``run`` executes the
    same static forward eagerly; that is how the padding is tested without a GPU.
    """

    def __init__(
        self,
        model: Transformer,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        scratch_block: int,
        width: int,
        sizes: Sequence[int] = GRAPH_BATCH_SIZES,
    ) -> None:
        import torch

        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.scratch_block, self.width = block_size, scratch_block, width
        self.sizes = tuple(sorted(sizes))
        n = self.sizes[-1]
        device = kv_caches[0][0].device
        head_dim = kv_caches[0][0].shape[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.zeros(n, dtype=torch.long, device=device)
        self.cos = torch.ones((n, 1, head_dim), dtype=model.dtype, device=device)  # position 0: no rotation
        self.sin = torch.zeros_like(self.cos)
        self.tables = torch.full((n, width), scratch_block, dtype=torch.long, device=device)
        self.lens = torch.ones(n, dtype=torch.long, device=device)
        self.starts = torch.zeros(n, dtype=torch.long, device=device)
        self.rows = torch.arange(n, device=device)
        self._pad(0, n)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # size -> (torch.cuda.CUDAGraph, its logits)

    def size_for(self, batch: Batch) -> int | None:
        """The size to pad ``batch`` to, or None when it must run eagerly."""
        if any(len(s.token_ids) != 1 or s.num_logits != 1 for s in batch.slices):
            return None  # prefill chunks, drafts being verified
        if any(s.start_pos >= self.width * self.block_size for s in batch.slices):
            return None
        return graph_batch_size(len(batch.slices), self.sizes)

    def run(self, ids: torch.Tensor, meta: AttentionMetadata, size: int) -> torch.Tensor:
        """Logits ``[n, vocab]`` of a decode step prepared on the host (rows ``n..size`` are padding)."""
        n = ids.shape[0]
        self._load(ids, meta, size)
        if size not in self.graphs:
            return self._forward_static(size)[:n]
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]  # a view of the graph's output: the caller copies it before the next replay

    def capture(self) -> None:
        """Capture every size; raises whatever the capture raises (the caller then runs eagerly)."""
        import torch

        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # the largest first: the others reuse its memory pool
                self._pad(0, size)
                warmup = torch.cuda.Stream()
                warmup.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(warmup):  # compiles the Triton kernels outside the capture
                    self._forward_static(size)
                torch.cuda.current_stream().wait_stream(warmup)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward_static(size)
                pool = graph.pool()
                self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    def _load(self, ids: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        n, width = ids.shape[0], meta.decode_tables.shape[1]
        self.ids[:n].copy_(ids, non_blocking=True)
        self.slots[:n].copy_(meta.slots, non_blocking=True)
        self.cos[:n].copy_(meta.cos, non_blocking=True)
        self.sin[:n].copy_(meta.sin, non_blocking=True)
        # Columns past ``width`` keep earlier steps' block ids: valid blocks, never read.
        self.tables[:n, :width].copy_(meta.decode_tables, non_blocking=True)
        self.lens[:n].copy_(meta.decode_lens, non_blocking=True)
        self.starts[:n].copy_(meta.decode_starts, non_blocking=True)
        self._pad(n, size)

    def _pad(self, start: int, stop: int) -> None:
        # cos/sin of padded rows keep whatever finite values they hold: nothing reads those rows' results.
        self.ids[start:stop] = 0
        self.slots[start:stop] = self.scratch_block * self.block_size
        self.tables[start:stop, 0] = self.scratch_block
        self.lens[start:stop] = 1
        self.starts[start:stop] = 0

    def _forward_static(self, size: int) -> torch.Tensor:
        from inferflux.backends.cpu.model import AttentionMetadata

        meta = AttentionMetadata(
            slots=self.slots[:size], cos=self.cos[:size], sin=self.sin[:size],
            decode_rows=slice(0, size), decode_tables=self.tables[:size],
            decode_lens=self.lens[:size], decode_starts=self.starts[:size],
            decode_mask=None, prefills=[],
        )
        return self.model(self.ids[:size], meta, self.kv_caches, self.rows[:size])


class CUDABackend(DeviceRunner):
    """PyTorch on a CUDA or ROCm GPU with the Triton kernels; CUDA graphs for decode steps.

    ``device`` and ``kernels`` are parameters so the same class runs on the CPU in
    tests (``kernels.reference``, or ``kernels.triton`` under ``TRITON_INTERPRET=1``).
    ``cuda_graphs=False`` (or ``INFERFLUX_CUDA_GRAPHS=0``) runs every step eagerly.
    """

    name: ClassVar[str] = "cuda"

    @classmethod
    def machine_reason(cls) -> str | None:
        """Why this machine lacks the hardware or toolkit, or None if it has it."""
        if importlib.util.find_spec("torch") is None:
            return "PyTorch is not installed"
        import torch

        if not torch.cuda.is_available():  # true on ROCm builds too (torch.version.hip)
            return f"no CUDA or ROCm device is visible to torch {torch.__version__}"
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed (pip install 'inferflux[cuda]')"
        return None

    @classmethod
    def probe(cls) -> str | None:
        return cls.machine_reason()

    def __init__(
        self,
        device: str = "cuda",
        kernels: ModuleType | None = None,
        cuda_graphs: bool | None = None,
        num_threads: int | None = None,
    ) -> None:
        if kernels is None:
            from inferflux.kernels import triton as kernels
        super().__init__(device, kernels, num_threads)
        if cuda_graphs is None:
            cuda_graphs = os.environ.get(GRAPHS_ENV, "1").strip().lower() not in {"0", "off", "false", "no"}
        # Graphs replay recorded CUDA (or HIP) launches: there is nothing to capture elsewhere.
        self.use_cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.decode_graphs: DecodeGraphs | None = None
        self.graph_error: str | None = None  # why decode steps run eagerly although graphs are on
        self.scratch_block = -1

    def _auto_dtype(self) -> str:
        if self.device.type == "cuda":
            return "bfloat16" if self._torch.cuda.is_bf16_supported() else "float16"
        return super()._auto_dtype()

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        # One block more than asked for: the padded rows of a graphed decode step write there.
        self.decode_graphs = None
        super().allocate_kv(num_blocks + 1, block_size)
        self.scratch_block = num_blocks
        if self.use_cuda_graphs:
            self._capture_graphs()

    def decode_graphs_for(self, sizes: Sequence[int] = GRAPH_BATCH_SIZES) -> DecodeGraphs:
        """Static decode buffers over this backend's model and cache (not yet captured)."""
        cfg = self._cfg
        blocks = -(-cfg.context_length // self.block_size)
        return DecodeGraphs(self.model, self.kv_caches, self.block_size, self.scratch_block,  # type: ignore[arg-type]
                            width=min(blocks, self.scratch_block), sizes=sizes)

    def _capture_graphs(self) -> None:
        graphs = self.decode_graphs_for()
        try:
            graphs.capture()
        except Exception as exc:  # e.g. a kernel that synchronises with the host: decode steps run eagerly
            self.graph_error = f"{type(exc).__name__}: {exc}".strip()
            log.warning("cuda backend: CUDA graph capture failed, decode steps run eagerly: %s", self.graph_error)
            return
        self.graph_error = None
        self.decode_graphs = graphs
        log.info("cuda backend: captured decode graphs for batch sizes %s", graphs.sizes)

    def forward(self, batch: Batch) -> Any:
        graphs = self.decode_graphs
        size = None if graphs is None or batch.block_size != self.block_size else graphs.size_for(batch)
        if size is None:
            return super().forward(batch)
        ids, meta, _ = self._prepare(batch, to_device=False)  # host tensors, copied into the static buffers
        with self._torch.inference_mode():
            return graphs.run(ids, meta, size).cpu()  # type: ignore[union-attr]
