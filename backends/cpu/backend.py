"""CPUBackend: turns the engine's integer batch into tensors and runs the model.

Loading runs the model through the load passes (``passes.py``); each step's
batch is flattened into tensors by ``step_inputs.py``; what the backend tunes in
its process (malloc, OpenMP) is in ``runtime.py``. torch is imported lazily so
that discovering and probing this backend works on a machine without it (the
probe then says what to install).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from inferflux.backends.base import Batch, BackendError, ModelInfo, ModelSpec, check_embed_args, choose_dtype
from inferflux.backends.cpu.pass_config import DENSE_DTYPES, PassConfig, PassRecord, requested_dtype
from inferflux.backends.cpu.runtime import (
    cpu_has_native_bf16,
    keep_freed_memory,
    release_freed_heap,
    release_openmp_pool,
)

if TYPE_CHECKING:
    import torch

    from inferflux.backends.cpu.model import AttentionMetadata, Transformer
    from inferflux.backends.cpu.swap import DiskSwap, HostSwap

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16")


def resolve_dtype(name: str) -> str:
    return choose_dtype(name, "cpu", DTYPES, lambda: "bfloat16" if cpu_has_native_bf16() else "float32")


class CPUBackend:
    name: ClassVar[str] = "cpu"
    # 8-token blocks: a sequence wastes half a block on average, 4 slots instead of 8, which takes
    # the serving benchmark's KV utilisation from 92 % to 96 %; on this backend the smaller blocks
    # cost no measurable speed (docs/benchmarks.md, "Serving against llama-server": KV slots used).
    default_block_size: ClassVar[int] = 8
    # Where weights and the KV cache live; the accelerator runners (backends.cuda)
    # subclass this backend with their own device, dtype choice and kernels.
    device: str | torch.device = "cpu"
    _resolve_dtype = staticmethod(resolve_dtype)

    @classmethod
    def probe(cls) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "PyTorch is not installed (pip install 'inferflux[cpu]')"
        return None

    def __init__(self, num_threads: int | None = None) -> None:
        import torch

        self._torch = torch
        keep_freed_memory()
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model: Transformer | None = None
        self.kernel_error: str | None = None  # why the compiled kernels are not in use, if they are not
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        self.swap: HostSwap | DiskSwap | None = None
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of positions 0..n-1 (_rope)

    def release_thread_pool(self) -> None:
        """Called on the loading thread before the engine thread takes over (see Backend)."""
        release_openmp_pool()

    # -- loading -----------------------------------------------------------------

    def load(self, spec: ModelSpec) -> ModelInfo:
        from inferflux.backends.cpu import quantise
        from inferflux.backends.cpu.model import Transformer
        from inferflux.backends.models import open_model

        torch = self._torch
        pass_config = self._pass_config(spec)
        dtype_name = self._resolve_dtype(requested_dtype(spec.dtype, pass_config))
        dtype = getattr(torch, dtype_name)
        source = open_model(spec.path)
        cfg = source.config
        # Built on the device, uninitialised (model.Linear): every weight is the file's.
        with torch.device(self.device):
            model = Transformer(cfg, dtype)
        self.kernel_error = self._use_kernels(model)
        # The weights' format is settled before they are read: the projections that will hold the file's blocks
        # alone are never decoded (the pages allocated for them are never touched, so they cost no memory either).
        mode = self._quantise_mode(source, pass_config, dtype_name)
        absent = quantise.file_block_names(model, source, mode) if mode else frozenset()
        try:
            model.load_weights(source.tensors(skip=absent), absent=absent)
        except ValueError as exc:
            raise BackendError(f"cannot load {spec.path}: {exc}") from exc
        model.eval()
        if spec.deterministic:
            self._use_invariant_kernels(model)
        records = self._run_passes(spec, model, source, pass_config, mode) if mode else []
        source.close()  # drop the file's mapping: the blocks kept are copies
        self.model = model
        self.dtype = dtype
        self.inv_freq = torch.from_numpy(cfg.rope_inv_freq())
        self._rope_tables = None
        log.info("%s backend: loaded %s (%s, %s, %d threads, %s attention, kernels for %s%s)", self.name, spec.name,
                 cfg.architecture, dtype_name, torch.get_num_threads(), self._attention_name(), self._kernels_isa(),
                 ", deterministic" if spec.deterministic else "")
        return dataclasses.replace(cfg.model_info(spec.name, dtype_name), deterministic=spec.deterministic,
                                   passes=tuple(r.as_dict() for r in records))

    def _pass_config(self, spec: ModelSpec) -> PassConfig:
        try:
            config = PassConfig.parse(spec.passes)
            requested_dtype(spec.dtype, config)
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        if str(self.device) != "cpu" and config.quantise not in ("auto", *DENSE_DTYPES):
            raise BackendError(f"passes.quantise {config.quantise} runs on the cpu backend only, not on {self.name}")
        return config

    def _quantise_mode(self, source: Any, config: PassConfig, dtype_name: str) -> str | None:
        """The quantise mode the load passes will run (``passes.resolve_mode``); None off the CPU, where none run."""
        from inferflux.backends.cpu import passes
        from inferflux.kernels import cpu as cpu_kernels

        if str(self.device) != "cpu":
            return None
        try:
            # auto never picks a mode that needs the kernels this backend is not using.
            exact_ok = self.kernel_error is None and passes.exact_available(source, dtype_name)
            mode = passes.resolve_mode(config.quantise, dtype_name=dtype_name, exact_ok=exact_ok,
                                       isa=cpu_kernels.isa() if self.kernel_error is None else "")
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        if mode not in DENSE_DTYPES and self.kernel_error is not None:
            raise BackendError(f"passes.quantise {mode} needs the C++ CPU kernels, which are unavailable: "
                               f"{self.kernel_error}")
        return mode

    def _run_passes(self, spec: ModelSpec, model: Transformer, source: Any, config: PassConfig,
                    mode: str) -> list[PassRecord]:
        """The load-time pass pipeline (backends/cpu/passes.py), logged."""
        from inferflux.backends.cpu import passes

        try:
            records = passes.run(model, source, config, mode)
        except ValueError as exc:
            raise BackendError(f"cannot load {spec.path}: {exc}") from exc
        if records[-1].bytes_after < records[0].bytes_before:
            release_freed_heap()  # the dense weights the passes replaced (keep_freed_memory holds freed pages)
        log.info("%s backend: %s passes: %s; weights %.1f -> %.1f MB", self.name, spec.name,
                 ", ".join(f"{r.name} ({r.status})" for r in records),
                 records[0].bytes_before / 1e6, records[-1].bytes_after / 1e6)
        return records

    def _kernels_isa(self) -> str:
        from inferflux.kernels import cpu as cpu_kernels

        return (cpu_kernels.isa() or "none") if str(self.device) == "cpu" else "-"

    def _attention_name(self) -> str:
        return "reference" if self.kernel_error else "C++ paged"

    @staticmethod
    def _use_kernels(model: Transformer) -> str | None:
        """Swap the compiled kernel set in (kernels/cpu/fast.py: fused elementwise ops and
        paged attention) where it builds; else why not."""
        from inferflux.kernels import cpu as cpu_kernels

        if cpu_kernels.load() is None:
            return cpu_kernels.load_error()
        from inferflux.kernels.cpu import fast

        model.use_kernels(fast)
        return None

    def _use_invariant_kernels(self, model: Transformer) -> None:
        """Deterministic mode: the batch-invariant kernel set (kernels/cpu/invariant.py) everywhere."""
        if str(self.device) != "cpu":
            raise BackendError(f"deterministic mode runs on the cpu backend only, not on {self.name}")
        if self.kernel_error is not None:
            raise BackendError(f"deterministic mode needs the C++ CPU kernels, which are unavailable: "
                               f"{self.kernel_error}")
        from inferflux.kernels.cpu import invariant

        model.use_invariant_kernels(invariant)

    # -- KV cache ----------------------------------------------------------------

    def kv_block_bytes(self, block_size: int) -> int:
        cfg = self._cfg
        elem = self._torch.finfo(self.dtype).bits // 8
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        torch, cfg = self._torch, self._cfg
        shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]
        self.block_size = block_size

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = self._torch.tensor([p[0] for p in pairs], device=self.device)
        dst = self._torch.tensor([p[1] for p in pairs], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(1, dst, k_cache.index_select(1, src))
            v_cache.index_copy_(1, dst, v_cache.index_select(1, src))

    # -- self-draft (speculative decoding, method "draft" with draft_layers) ------

    def truncated(self, num_layers: int) -> CPUBackend:
        """A backend running this model's first ``num_layers`` layers, then its final
        norm and head: a self-draft. It shares the weights and gets a KV cache of
        its own from ``allocate_kv``."""
        import copy

        model = self.model
        if model is None:
            raise BackendError("no model loaded")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < model.cfg.num_layers:
            raise BackendError(f"a self-draft takes 1 to {model.cfg.num_layers - 1} of the model's layers, "
                               f"not {num_layers!r}")
        head = model.truncated(num_layers)  # the draft's parameters are the target's tensors, not copies
        head.use_paged_attention(model.layers[0].attn.paged_attention)
        head.eval()
        draft = copy.copy(self)  # the same device, dtype and kernels
        draft.model, draft.kv_caches, draft.block_size, draft.swap = head, [], 0, None
        return draft

    # -- swap (backends.base: preemption by swapping) -----------------------------

    def allocate_swap(self, num_slots: int, block_size: int, directory: str | None) -> None:
        from inferflux.backends.cpu.swap import DiskSwap, HostSwap

        if not self.kv_caches or block_size != self.block_size:
            raise BackendError("allocate_swap needs allocate_kv first, with the same block size")
        if self.swap is not None:
            self.swap.close()
        slot_bytes = self.kv_block_bytes(block_size)
        self.swap = HostSwap(num_slots, slot_bytes) if directory is None else DiskSwap(num_slots, slot_bytes, directory)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        from inferflux.backends.cpu.swap import gather_blocks

        swap = self._swap_space()
        swap.write([slot for _, slot in pairs], gather_blocks(self.kv_caches, [block for block, _ in pairs]))

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        from inferflux.backends.cpu.swap import scatter_blocks

        swap = self._swap_space()
        scatter_blocks(self.kv_caches, [block for _, block in pairs], swap.read([slot for slot, _ in pairs]))

    def _swap_space(self) -> HostSwap | DiskSwap:
        if self.swap is None:
            raise BackendError("swap_out/swap_in called before allocate_swap()")
        return self.swap

    # -- the step ----------------------------------------------------------------

    def forward(self, batch: Batch) -> Any:
        torch = self._torch
        if self.model is None or not self.kv_caches:
            raise BackendError("forward called before load() and allocate_kv()")
        if batch.block_size != self.block_size:
            raise BackendError(f"batch block size {batch.block_size} != cache block size {self.block_size}")
        ids, meta, logits_index = self._prepare(batch)
        with torch.inference_mode():
            return self.model(ids, meta, self.kv_caches, logits_index)

    # -- embeddings (backends.base: the optional embed) ---------------------------

    def embed(self, token_lists: Sequence[Sequence[int]], pooling: str) -> Any:
        """Each token list's pooled final hidden states, float32 ``[n, hidden]`` (see ``Backend``).

        The lists run as fresh sequences in one forward without a KV cache, so
        the cache of the sequences the engine is generating is neither read nor
        written, and nothing of the batch is kept.
        """
        torch = self._torch
        check_embed_args(self.model is not None, token_lists, pooling)
        ids, meta = self._prepare_fresh(token_lists)
        lengths = torch.tensor([len(tokens) for tokens in token_lists])
        # "last" needs one row a sequence through the final norm; "mean" all of them.
        rows = torch.cumsum(lengths, 0) - 1 if pooling == "last" else None
        ids, meta, rows = self._on_device(ids, meta, rows)
        with torch.inference_mode():
            h = self.model.hidden_states(ids, meta, None, rows).float()
            if pooling == "mean":
                lengths = lengths.to(h.device)
                segment = torch.repeat_interleave(torch.arange(len(token_lists), device=h.device), lengths)
                h = torch.zeros(len(token_lists), h.shape[1], device=h.device).index_add_(0, segment, h)
                h = h / lengths[:, None]
        return h.cpu().numpy()

    def _prepare_fresh(self, token_lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Token ids and attention metadata of sequences that each start at position 0 and keep no KV."""
        from inferflux.backends.cpu.step_inputs import fresh_inputs

        return fresh_inputs(token_lists, self._rope)

    def _on_device(
        self, ids: torch.Tensor, meta: AttentionMetadata, index: torch.Tensor | None
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """The host-built step tensors where the model runs: here, the host already (DeviceRunner moves them)."""
        return ids, meta, index

    @property
    def _cfg(self):
        if self.model is None:
            raise BackendError("no model loaded")
        return self.model.cfg

    def _rope(self, pos: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE cos/sin rows of ``pos`` (all below ``end``), looked up in tables of rope_cos_sin over
        positions 0..n-1, made once and doubled when a position reaches past them: each row is computed
        as before, once per model instead of six ops every step."""
        from inferflux.kernels.reference import rope_cos_sin

        tables = self._rope_tables
        if tables is None or end > tables[0].shape[0]:
            n = max(1024, 1 << max(end - 1, 1).bit_length())
            tables = self._rope_tables = rope_cos_sin(self._torch.arange(n), self.inv_freq, self.dtype)
        return tables[0].index_select(0, pos), tables[1].index_select(0, pos)

    def _prepare(self, batch: Batch) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the batch: token ids, cache slots, rope rows and attention groups (``step_inputs``)."""
        from inferflux.backends.cpu.step_inputs import step_inputs

        mask_group = None
        if self.kernel_error is not None:  # the reference path takes its decode mask from here, built once a step
            cfg = self._cfg
            mask_group = cfg.num_heads // cfg.num_kv_heads
        return step_inputs(batch, self._rope, mask_group)
