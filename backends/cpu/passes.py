"""The load-time pass pipeline of the CPU backend: the loaded model goes through named passes.

``PASSES`` lists them in order. Each takes the model, the model source and the
``PassConfig`` and returns what it did (a ``PassRecord``: ran, or done at load by
the model's own code, with a detail and the weight bytes before and after); the
records are logged at load and shown by ``GET /admin/v1/models/{id}`` and
``inferctl backends --json``.

* ``fuse_qkv`` and ``fuse_gate_up``: the projections are fused as the weights are read
  (``backends/models/layout.py`` stacks q/k/v and gate/up into one matrix each); the
  pass checks the fused shapes and records it.
* ``fuse_add_rmsnorm``: ``Block`` adds the residual and normalises in one kernel call
  (``add_rms_norm`` of the kernel set); recorded.
* ``quantise``: the weights' format. ``native`` keeps the GGUF file's own blocks
  (Q4_0/Q4_1/Q8_0: no re-quantisation error; other types stay dense); ``hybrid`` keeps the
  blocks for single rows and the loaded dense weights for batches (at the dense weights' memory
  plus the blocks'); ``exact`` keeps both too, but multiplies small batches' rows by the
  blocks decoded to the dense weights' own values (``exact_linear``), so every batch size
  multiplies the same numbers: the default for a quantised file where the kernel builds for the
  model's dtype (bfloat16: AVX-512 BF16; float32: AVX-512F), deterministic mode included (there
  ``invariant_linear`` on the dense weights takes the batches, the same bits as ``exact_linear``);
  ``int8`` re-quantises
  float weights to Q8_0 (int8, a float16 scale per 32); ``int4`` to Q4_1 (4 bits, a
  scale and minimum per 32); ``bf16``/``f32`` keep dense weights in the model's dtype.
* ``choose_kernels``: each quantised projection's row threshold for the GEMM path
  (``backends.cpu.linear.GEMM_FROM_ROWS`` unless configured), and the deterministic flag;
  bfloat16 dense weights (every projection in ``auto``/``bf16``, the batches' weights in
  ``hybrid``, the head) are packed once for oneDNN (``backends.cpu.linear.pack``: the same
  bits as ``F.linear``, which packs them on every call) unless ``pack: false``; the copies
  sit beside the weights, so dense weight memory doubles (the record says by how much).
* ``decode_loop``: the C++ loop over layers (``backends/cpu/decode_loop.py``) takes the decode
  steps of single-token rows, calling the kernels and ops the Python path would (``qmatmul`` on
  blocks, oneDNN or torch's linear on dense weights); skipped, saying why, where it cannot stand
  for the Python path (deterministic mode, another kernel set, q/k norms) or with ``decode_loop: false``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch
from torch import nn

from inferflux.backends.cpu import linear as ql
from inferflux.backends.cpu.pass_config import DENSE_DTYPES, EXACT_MODES, PassConfig, PassRecord, requested_dtype
from inferflux.backends.cpu.quantise import quantise

log = logging.getLogger(__name__)


def resolve_mode(mode: str, *, dtype_name: str, exact_ok: bool = False, isa: str = "") -> str:
    """``auto``: where the file stores its projections in blocks and ``exact_linear`` builds for the
    model's dtype (``exact_ok``), those blocks are the weights: ``blocks`` (``exact_linear`` at every row
    count, nothing dense: the weights in memory are the file's size) — except on a build for AVX-512
    (``isa``, the kernels' ``isa()``) in bfloat16 or float32, where ``exact`` keeps the dense weights beside
    the blocks for batches of ``gemm_from`` rows and more (oneDNN's or torch's GEMM there, measured faster
    than the block kernel at those sizes; docs/backends.md). Without blocks or the kernel: the dense
    weights in the model's dtype.

    Not ``hybrid``, though it multiplies a single row as fast: its one-row steps (the blocks'
    kernel, int8 activations) and its batched steps (a GEMM on the dense weights) multiply different
    numbers, so a greedy answer would change with whether other requests share its step; three
    gateways over two engines answered one prompt two ways in CI. ``native`` would change every
    answer (int8 activations) and is slower for batches. Both are a choice to make per model
    (docs/backends.md says what each costs)."""
    if mode in EXACT_MODES and dtype_name not in EXACT_DTYPES:
        raise ValueError(f"passes.quantise {mode} multiplies bfloat16 or float32 rows; dtype {dtype_name} contradicts it")
    if mode != "auto":
        return mode
    if exact_ok:
        return "exact" if isa.startswith("avx512") else "blocks"
    return "bf16" if dtype_name == "bfloat16" else "f32"


# The dtypes exact_linear multiplies (bfloat16 needs AVX-512 BF16, float32 AVX-512F).
EXACT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def exact_available(source: Any, dtype_name: str) -> bool:
    """Whether ``auto`` may resolve to ``exact`` for this source in this dtype: its projections in
    blocks the kernel reads, and the kernel built here for rows of that dtype."""
    from inferflux.kernels import cpu as cpu_kernels

    dtype = EXACT_DTYPES.get(dtype_name)
    return dtype is not None and cpu_kernels.exact_linear_supported(dtype) and quantised_file(source, dtype)


def plan(value: Mapping[str, Any] | None, dtype: str, path: str,
         resolve_dtype: Callable[[str], str]) -> dict[str, Any]:
    """What loading ``path`` with these passes would do here, without loading it (``inferctl backends
    --json``): the passes in order, the quantise mode they resolve to and the kernels' instruction set
    (``cpu_isa``; None without them) with the level asked for (``cpu_isa_requested``); what ran and the weight bytes
    before and after are known only after a load (``GET /admin/v1/models/{id}``). ``error``: why it
    would not load (a bad passes section, a contradicting dtype, an unreadable file, no C++ kernels).
    ``resolve_dtype``: the backend's (backends.cpu.backend.resolve_dtype, which imports this module)."""
    from inferflux.backends.models import open_model
    from inferflux.kernels import cpu as cpu_kernels

    out: dict[str, Any] = {"pipeline": [name for name, _ in PASSES], "quantise": None}
    try:
        config = PassConfig.parse(value)
        wanted = requested_dtype(dtype, config)
        dtype_name = resolve_dtype(wanted)
        source = open_model(path)
        quantised = quantised_file(source)
        kernels_ok = cpu_kernels.load() is not None  # built once and cached, as the first load would
    except Exception as exc:  # a diagnostic: every reason a load would fail is reported, none raised
        return {**out, "error": str(exc)}
    try:
        mode = resolve_mode(config.quantise, dtype_name=dtype_name, exact_ok=exact_available(source, dtype_name),
                            isa=cpu_kernels.isa())
    except ValueError as exc:
        return {**out, "error": str(exc)}
    # cpu_isa_requested says why that level: auto (built for this CPU) or one pinned by runtime.cpu_isa.
    out.update(quantise=mode, dtype=dtype_name, quantised_file=quantised, cpu_isa=cpu_kernels.isa() or None,
               cpu_isa_requested=cpu_kernels.requested_isa())
    if mode not in DENSE_DTYPES and not kernels_ok:
        out["error"] = f"passes.quantise {mode} needs the C++ CPU kernels: {cpu_kernels.load_error()}"
    return out


def run(model: nn.Module, source: Any, config: PassConfig, mode: str) -> list[PassRecord]:
    """Every pass in order over ``model`` (loaded), with ``mode`` the resolved quantisation."""
    records = []
    for name, fn in PASSES:
        before = ql.weight_bytes(model)
        status, detail = fn(model, source, config, mode)
        records.append(PassRecord(name, status, detail, before, ql.weight_bytes(model)))
    return records


def fuse_qkv(model: Any, source: Any, config: PassConfig, mode: str) -> tuple[str, str]:
    cfg = model.cfg
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    got = {_out_features(layer.attn.qkv) for layer in model.layers}
    if got != {width}:
        raise ValueError(f"fuse_qkv: projections of {sorted(got)} rows, expected {width}")
    return "done at load", f"q, k, v stacked into one [{width}, {cfg.hidden_size}] projection a layer (layout.py)"


def fuse_gate_up(model: Any, source: Any, config: PassConfig, mode: str) -> tuple[str, str]:
    width = 2 * model.cfg.intermediate_size
    got = {_out_features(layer.mlp.gate_up) for layer in model.layers}
    if got != {width}:
        raise ValueError(f"fuse_gate_up: projections of {sorted(got)} rows, expected {width}")
    return "done at load", f"gate and up stacked into one [{width}, {model.cfg.hidden_size}] projection a layer"


def fuse_add_rmsnorm(model: Any, source: Any, config: PassConfig, mode: str) -> tuple[str, str]:
    return "done at load", "residual add + RMSNorm run as one add_rms_norm kernel call (Block.forward)"


def choose_kernels(model: Any, source: Any, config: PassConfig, mode: str) -> tuple[str, str]:
    deterministic = bool(getattr(model, "deterministic", False))
    hybrid, exact = mode == "hybrid", mode in EXACT_MODES
    exact_from = ql.EXACT_GEMM_FROM_ROWS if model.dtype == torch.bfloat16 else ql.EXACT_F32_GEMM_FROM_ROWS
    default_from = ql.DENSE_GEMM_FROM_ROWS if hybrid else exact_from if exact else ql.GEMM_FROM_ROWS
    # blocks: nothing dense to run a GEMM on, so exact_linear takes every row count (gemm_from is ignored).
    gemm_from = ql.NO_GEMM if mode == "blocks" else config.gemm_from or default_from
    quantised = [m for m in model.modules() if isinstance(m, ql.QuantLinear)]
    if exact:
        from inferflux.kernels import cpu as cpu_kernels

        if not cpu_kernels.exact_linear_supported(model.dtype):
            need = "AVX-512 BF16" if model.dtype == torch.bfloat16 else "the C++ kernels"
            raise ValueError(f"passes.quantise {mode} needs the exact_linear kernel for {model.dtype} rows ({need}), "
                             "not built here")
        if isinstance(model.head_linear, ql.QuantHead):  # a plain attribute, not among the modules
            quantised.append(model.head_linear.linear)
    for m in quantised:
        m.gemm_from, m.deterministic, m.exact = gemm_from, deterministic, exact
    if not quantised:
        if deterministic:  # Transformer.use_invariant_kernels put them on the invariant kernel
            return "ran", "deterministic: dense projections through the batch-invariant invariant_linear"
        return "ran", "dense projections: torch GEMM at every batch size" + _pack_dense(model, config)
    if mode == "blocks":
        return "ran", "exact_linear on the blocks at every batch size (decoded in registers for 1-4 rows, eight weight " \
                      "rows at a time for more): no dense weights"
    if deterministic and exact:  # invariant_linear needs the plain dense weights: nothing to pack
        return "ran", (f"deterministic: exact_linear below {gemm_from} rows, invariant_linear on the dense "
                       f"weights from {gemm_from} (the same bits)")
    if deterministic:
        return "ran", "deterministic: the batch-invariant qmatmul kernel at every batch size"
    batch = "GEMM on the dense weights" if hybrid or exact else "dequantise-per-tile + GEMM"
    packed = _pack_dense(model, config) if hybrid or exact else ""
    small = "exact_linear (the blocks decoded to the dense weights' values)" if exact else "qmatmul kernel"
    return "ran", f"{small} below {gemm_from} rows, {batch} from {gemm_from}" + packed


def _pack_dense(model: Any, config: PassConfig) -> str:
    """Pack the bfloat16 dense weights GEMMs multiply (``linear.pack``); what was packed, for the record."""
    if config.pack is False:
        return "; not packed (pack: false)"
    done = total = alone = 0
    head = model.head_linear
    beside_blocks = [m for m in model.modules() if isinstance(m, ql.QuantLinear)]
    if isinstance(head, ql.QuantHead):  # not among the modules
        beside_blocks.append(head.linear)
    for m in list(model.modules()):
        if isinstance(m, nn.Linear) and m is not model.lm_head:
            total += 1
            done += ql.use_packed(m)
    for m in beside_blocks:
        if m.dense_weight is not None:
            total += 1
            done += _pack_beside_blocks(m)
            alone += m.dense_weight is None
    head_weight = (model.embed.weight if model.lm_head is None and isinstance(model.embed, nn.Embedding)
                   else getattr(model.lm_head, "weight", None) if isinstance(model.lm_head, nn.Linear) else None)
    if head_weight is not None:
        total += 1
        packed = ql.pack(head_weight)
        if packed is not None:
            model.head_linear = ql.PackedHead(packed)
            done += 1
    if not done:
        if total and model.dtype != torch.bfloat16:
            return f"; not packed ({model.dtype} weights: oneDNN's packing here is bfloat16's)"
        return "; not packed (oneDNN's bfloat16 packing is not available here, or not bit-identical)" if total else ""
    where = f"{alone} beside blocks in place of the plain weights, the rest beside them" if alone else "copies beside them"
    return f"; {done} of {total} dense weights packed once for oneDNN ({where})"


def _pack_beside_blocks(m: ql.QuantLinear) -> bool:
    """Pack a QuantLinear's dense weight (hybrid, exact). An exact projection then drops the plain
    copy: its blocks are the small batches' weights and the packed copy the rest's (``pack`` has
    checked that copy's bits), so nothing reads it and a third of its weight memory goes."""
    m.packed_dense = ql.pack(m.dense_weight)
    if m.packed_dense is None:
        return False
    if m.exact and not m.deterministic:
        m.dense_weight = None
    return True


def decode_loop(model: Any, source: Any, config: PassConfig, mode: str) -> tuple[str, str]:
    from inferflux.backends.cpu.decode_loop import DecodeLoop, why_not

    if config.decode_loop is False:
        return "skipped", "decode_loop: false (every step runs the layers from Python)"
    reason = why_not(model)
    if reason is not None:
        return "skipped", reason
    model.decode_loop = DecodeLoop(model)
    rows = model.decode_loop.max_rows
    return "ran", f"decode steps of {'1 row' if rows == 1 else f'1 to {rows} rows'} run every layer in one C++ call"


PASSES: tuple[tuple[str, Callable[..., tuple[str, str]]], ...] = (
    ("fuse_qkv", fuse_qkv), ("fuse_gate_up", fuse_gate_up), ("fuse_add_rmsnorm", fuse_add_rmsnorm),
    ("quantise", quantise), ("choose_kernels", choose_kernels), ("decode_loop", decode_loop),
)


def quantised_file(source: Any, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the source stores the first layer's projections in a type exact_linear multiplies for rows of
    ``dtype`` (``ql.multiplies``: the K types in float32 only)."""
    stored = getattr(source, "stored_blocks", None)
    if stored is None:
        return False
    got = stored("model.layers.0.self_attn.o_proj.weight")
    return got is not None and ql.multiplies(got[0], exact=True, dtype=dtype)


def _out_features(module: nn.Module) -> int:
    return int(module.out_features)
