"""The accelerator runner: the CPU backend's model and batching on any torch device.

``DeviceRunner`` is ``CPUBackend`` with three things made parameters: the device
the weights and the paged KV cache live on, the dtype chosen for ``auto``, and the
*kernel set* the model runs (``kernels.triton`` on CUDA/ROCm, ``kernels.metal`` on
Apple GPUs, ``kernels.reference`` or the Triton kernels under the interpreter for
tests on the CPU). A batch is still flattened on the host (``CPUBackend._prepare``)
and its few small index tensors are copied over; logits come back to the host as
float32 for the engine's sampler.

``CUDABackend`` adds CUDA graphs for decode-only steps (``graphs.DecodeGraphs``) and swaps
preempted sequences' blocks to pinned host memory without waiting for the copy
(``swap.DeviceSwap``).
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
from inferflux.backends.cuda.graphs import GRAPH_BATCH_SIZES, DecodeGraphs
from inferflux.backends.cuda.swap import DeviceSwap
from inferflux.kernels.errors import KernelError

if TYPE_CHECKING:
    import torch

    from inferflux.backends.cpu.model import AttentionMetadata, Transformer

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "float16", "bfloat16")
GRAPHS_ENV = "INFERFLUX_CUDA_GRAPHS"  # "0" runs every step eagerly

_D = TypeVar("_D")


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
