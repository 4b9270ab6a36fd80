"""Projections whose weights stay in ggml's quantised blocks (the ``quantise`` pass).

``QuantLinear`` takes an ``nn.Linear``'s place (same call, same result dtype) and keeps
its weight as ``uint8 [out, row_bytes]`` blocks (Q4_0, Q4_1 or Q8_0; Q4_K or Q6_K in the
``exact`` and ``blocks`` modes on float32 rows, see ``EXACT_ONLY``), four to eight times
smaller than bfloat16. Which kernel runs depends on the number of rows:

* below ``gemm_from`` rows (decode: memory-bound), ``kernels.cpu.qmatmul``, which reads
  the blocks as they are and is batch-invariant (a row's result never depends on
  the other rows);
* from ``gemm_from`` rows on (prefill: compute-bound), the weight is dequantised tile
  by tile into the activations' dtype and multiplied with torch's GEMM; only one tile
  is ever dense, so memory stays at the blocks' size.

With a ``dense`` weight (the ``hybrid`` and ``exact`` modes: the loaded bfloat16 or float32 weights
kept beside the blocks), the second path is a plain GEMM on it instead, from ``DENSE_GEMM_FROM_ROWS``
rows (hybrid) or ``EXACT_GEMM_FROM_ROWS`` (exact). With ``exact`` set, the first path is
``kernels.cpu.exact_linear`` instead of ``qmatmul``: the activations times the blocks decoded
to those same weights, in their dtype, so small batches read the blocks and still multiply the numbers
the batches' GEMM multiplies (``qmatmul`` rounds the activations to int8 first).
A deterministic model (``deterministic`` True) always takes ``qmatmul``, except with ``exact``: there
``exact_linear`` below ``gemm_from`` and ``invariant_linear`` on the dense weights from there, which
are the same bits, so a row's result never depends on the batch.
``QuantEmbedding`` is the token embedding in blocks (a lookup dequantises the rows
it needs); with tied embeddings it shares its blocks with the output head.

``pack`` gives a bfloat16 weight packed once into oneDNN's blocked layout: ``F.linear``
hands the same weight to oneDNN, which reorders it on every call. Multiplying with the
packed copy gives the same bits (checked on each weight at load; where it would not,
nothing is packed) and takes a third less time at 32 rows (benchmarks/bench_packed_linear.py).
``use_packed`` puts it under a dense ``nn.Linear``, ``PackedHead`` under a tied head.
"""

from __future__ import annotations

import torch
from torch import nn

from inferflux.kernels import cpu as cpu_kernels

# ggml type ids the C++ kernels multiply (kernels/cpu/kernels.h), and their blocks' size in bytes and values:
# 32 values a block, 256 a K type's super-block.
BLOCK_BYTES: dict[int, int] = {2: 18, 3: 20, 8: 34, 12: 144, 14: 210}  # Q4_0, Q4_1, Q8_0, Q4_K, Q6_K
BLOCK_VALUES: dict[int, int] = {2: 32, 3: 32, 8: 32, 12: 256, 14: 256}
QTYPE_NAMES: dict[int, str] = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}
# The types only exact_linear multiplies, and only float32 rows of them (exact_core.cpp): no qmatmul, no
# bfloat16 kernel. They are kept as blocks in the exact and blocks modes of a float32 model, else left dense.
EXACT_ONLY = frozenset({12, 14})


def multiplies(qtype: int, *, exact: bool, dtype: torch.dtype) -> bool:
    """Whether a kernel here multiplies blocks of ``qtype`` for a model of ``dtype`` (``exact``: by
    ``exact_linear``, the exact and blocks modes; else by ``qmatmul``)."""
    if qtype not in BLOCK_BYTES:
        return False
    return qtype not in EXACT_ONLY or (exact and dtype == torch.float32)


def row_bytes(qtype: int, in_features: int) -> int | None:
    """Bytes of one row of ``in_features`` weights of ``qtype``; None where they are not whole blocks."""
    values = BLOCK_VALUES[qtype]
    return None if in_features % values else in_features // values * BLOCK_BYTES[qtype]

# Batch rows from which dequantise-per-tile + GEMM beats qmatmul over a layer's four
# projections: 32, measured by benchmarks/bench_qmatmul.py (--threads 1 --fastest) on the
# 2-core AMD EPYC (AVX-512 VNNI) at load 13-17: 110 vs 83 ms at 32 rows, 54 vs 62 ms at 16
# (benchmarks/results/results-2026-11-26-qmatmul.json; docs/benchmarks.md, "Kernels and weights on the CPU"). Provisional.
GEMM_FROM_ROWS = 32
# With the dense weights kept (hybrid), from how many rows their GEMM replaces qmatmul: 2. Measured
# by bench_qmatmul.py (--threads 2 --fastest) on the 2-core AMD EPYC at load 1.5-2.5: over a layer's
# four projections qmatmul 7.3 ms at 1 row, 13.1 at 2; bfloat16 GEMM 7.0 and 7.1 (the Q8_0 head at 1
# row: 0.64 ms from blocks, 3.4 dense, so one row still reads the blocks).
DENSE_GEMM_FROM_ROWS = 2
# Output rows dequantised at a time on the GEMM path: a tile of bfloat16 weights
# (256 x 1536 x 2 bytes = 768 KiB at most here) is still in cache when the GEMM reads it.
TILE_ROWS = 256
# The exact mode: rows from which the packed bfloat16 GEMM replaces exact_linear. Measured by
# benchmarks/bench_exact_linear.py on the 2-core AMD EPYC (AVX-512 BF16), 2026-11-26: over the model's
# projections, alternating, exact_linear took 3.6 against 8.2 ms a step at 1 row, 6.7 against 8.7-10.1 at 8,
# and 9.9-10.7 against 9.6-10.3 at 9-12 (docs/benchmarks.md, "Kernels and weights on the CPU").
EXACT_GEMM_FROM_ROWS = 9
# The same in float32 (a CPU without AVX-512 BF16), against F.linear on the dense float32 weights (what
# ``f32`` runs), measured the same way on a 2-core Intel Xeon without BF16, 2026-11-27: exact_linear took
# 8.6 against 19.8 ms a step at 1 row, 46.6 against 52.0 at 24 and 62.6 against 57.8 at 32.
EXACT_F32_GEMM_FROM_ROWS = 25
# gemm_from of the ``blocks`` mode, where no dense weight exists: exact_linear multiplies every row count.
NO_GEMM = 1 << 62


class QuantLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` as ggml blocks; drop-in for ``nn.Linear``."""

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int, bias: torch.Tensor | None = None,
                 *, gemm_from: int = GEMM_FROM_ROWS, deterministic: bool = False,
                 dense: torch.Tensor | None = None) -> None:
        super().__init__()
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"no kernel for ggml type {qtype}; quantised types: {sorted(QTYPE_NAMES.values())}")
        if blocks.dim() != 2 or blocks.shape[1] != row_bytes(qtype, in_features):
            raise ValueError(f"blocks of shape {tuple(blocks.shape)} do not hold {in_features} inputs of type "
                             f"{QTYPE_NAMES[qtype]}")
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        if dense is not None and tuple(dense.shape) != (blocks.shape[0], in_features):
            raise ValueError(f"dense weight of shape {tuple(dense.shape)} for {blocks.shape[0]} x {in_features}")
        self.register_buffer("dense_weight", dense, persistent=False)
        # ``dense_weight`` packed (``pack``), by a load pass; in the exact mode it then stands alone (dense_weight None).
        self.register_buffer("packed_dense", None, persistent=False)
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.gemm_from = gemm_from
        self.deterministic = deterministic
        self.exact = False  # below gemm_from: exact_linear (bfloat16 or float32 rows) instead of qmatmul; set by a load pass

    @property
    def qtype_name(self) -> str:
        return QTYPE_NAMES[self.qtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        exact = self.exact and rows.dtype in (torch.bfloat16, torch.float32)
        if exact and rows.shape[0] < self.gemm_from:
            y = cpu_kernels.exact_linear(rows, self.blocks, self.qtype)
        elif exact and self.deterministic:  # exact_linear's bits from the dense weights, at a GEMM's pace
            y = cpu_kernels.loaded().invariant_linear(rows, self.dense_weight, None)
        elif self.deterministic or rows.shape[0] < self.gemm_from:
            y = cpu_kernels.qmatmul(rows, self.blocks, self.qtype).to(x.dtype)
        elif self.packed_dense is not None:  # ``pack`` packs bfloat16 weights only
            y = packed_linear(rows.to(torch.bfloat16), self.packed_dense).to(x.dtype)
        elif self.dense_weight is not None:
            y = torch.nn.functional.linear(rows.to(self.dense_weight.dtype), self.dense_weight).to(x.dtype)
        else:
            y = self._gemm(rows)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _gemm(self, rows: torch.Tensor) -> torch.Tensor:
        bf16 = rows.dtype == torch.bfloat16
        x = rows if bf16 else rows.float()
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype)
        for start in range(0, self.out_features, TILE_ROWS):
            tile = cpu_kernels.dequantize_blocks(self.blocks[start : start + TILE_ROWS], self.qtype,
                                                 self.in_features, bf16)
            torch.mm(x, tile.t(), out=out[:, start : start + tile.shape[0]])
        return out.to(rows.dtype)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight dequantised, ``[out, in]`` (the reference the tests compare against)."""
        w = cpu_kernels.dequantize_blocks(self.blocks, self.qtype, self.in_features, dtype == torch.bfloat16)
        return w.to(dtype)

    def extra_repr(self) -> str:
        kernel = ", exact" if self.exact else ""
        return f"in={self.in_features}, out={self.out_features}, {self.qtype_name}, gemm_from={self.gemm_from}{kernel}"


class StackedQuantLinear(nn.Module):
    """A fused projection (q, k and v; gate and up) whose parts the file stores in different block types, as
    llama.cpp's Q4_K_M stores attn_v in Q6_K beside q and k in Q4_K: one ``QuantLinear`` a run of rows of one
    type, their outputs side by side. ``exact_linear`` computes each output by itself (its reduction never
    depends on the other outputs), so in the exact and blocks modes the result is the same bits as one
    projection of the stacked weights."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError(f"stacked parts of {sorted({p.in_features for p in parts})} inputs")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stacked weight dequantised, ``[out, in]``."""
        return torch.cat([p.dense(dtype) for p in self.parts])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {'+'.join(p.qtype_name for p in self.parts)}"


def quant_linear(parts: list[tuple[int, torch.Tensor]], in_features: int, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None) -> QuantLinear | StackedQuantLinear:
    """A projection of blocks ``parts`` (``(qtype, uint8 [rows, row_bytes])`` in output order): one
    ``QuantLinear`` where they are of one type, else a ``StackedQuantLinear`` of one a run of rows of a type.
    ``bias`` and ``dense`` are the whole projection's, split among the parts."""
    runs: list[tuple[int, list[torch.Tensor]]] = []
    for qtype, blocks in parts:
        if runs and runs[-1][0] == qtype:
            runs[-1][1].append(blocks)
        else:
            runs.append((qtype, [blocks]))
    linears, start = [], 0
    for qtype, pieces in runs:
        blocks = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        rows = slice(start, start + blocks.shape[0])
        start = rows.stop
        linears.append(QuantLinear(blocks, qtype, in_features, None if bias is None else bias[rows],
                                   dense=None if dense is None else dense[rows]))
    return linears[0] if len(linears) == 1 else StackedQuantLinear(linears)


class QuantEmbedding(nn.Module):
    """Token embedding in ggml blocks: a lookup dequantises only the rows it reads."""

    def __init__(self, blocks: torch.Tensor, qtype: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"no kernel for ggml type {qtype}")
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.qtype = qtype
        self.dim = dim
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        """The blocks, where ``Transformer.forward`` reads a tied head's weight for ``head_linear``
        (a ``QuantHead`` then, which ignores it)."""
        return self.blocks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1))
        out = cpu_kernels.dequantize_blocks(rows, self.qtype, self.dim, self.dtype == torch.bfloat16)
        return out.to(self.dtype).view(*ids.shape, self.dim)


class QuantHead:
    """The output projection for ``Transformer.head_linear``: ``(h, _) -> logits`` from blocks.

    The second argument (the dense head weight the default ``F.linear`` takes) is ignored:
    here the head is ``linear``'s blocks.
    """

    def __init__(self, linear: QuantLinear) -> None:
        self.linear = linear

    def __call__(self, h: torch.Tensor, _weight: object = None) -> torch.Tensor:
        return self.linear(h)


# The batch size oneDNN is told to pack for: the serving batches the gain was measured at. The
# packed weight serves every other row count too, with the same bits (pack checks 1 and 33 rows).
PACK_FOR_ROWS = 32


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for 2-D ``x``, with ``W`` as ``pack`` returned it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``weight`` ([out, in], bfloat16, on the CPU) packed for oneDNN, or None where that is not
    available here or would not give ``F.linear``'s bits (float32: there torch calls another GEMM)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)
        generator = torch.Generator().manual_seed(0)
        for rows in (1, PACK_FOR_ROWS + 1):
            probe = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
            if not torch.equal(packed_linear(probe, packed, bias), torch.nn.functional.linear(probe, weight, bias)):
                return None
    except RuntimeError:  # an op this torch build lacks, or a layout it refuses
        return None
    return packed


def use_packed(module: nn.Linear) -> bool:
    """Run ``module`` (a dense ``nn.Linear``) on its weight packed once; False where ``pack`` declines.
    Its ``weight`` stays as it was, for whatever else reads it (a self-draft shares it)."""
    packed = pack(module.weight, module.bias)
    if packed is None:
        return False
    module.register_buffer("packed_weight", packed, persistent=False)
    bias = module.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x.reshape(-1, x.shape[-1]), packed, bias).view(*x.shape[:-1], packed.shape[0])

    forward.packed = packed  # type: ignore[attr-defined]  # for dense_operand
    module.forward = forward  # type: ignore[method-assign]
    return True


def dense_operand(module: nn.Module) -> torch.Tensor | None:
    """The weight a dense ``nn.Linear``'s forward multiplies, for a caller that runs the same op itself
    (the decode loop): the packed copy under ``use_packed``'s forward (``packed_linear``), the plain weight
    under ``nn.Linear``'s own (``F.linear``); None for any other forward (deterministic mode's) or module."""
    if not isinstance(module, nn.Linear):
        return None
    forward = vars(module).get("forward")
    if forward is None:
        return module.weight.detach()
    return getattr(forward, "packed", None)


class PackedHead:
    """A dense head for ``Transformer.head_linear`` on a packed copy of its weight (the embedding's, when
    tied); like ``QuantHead`` it ignores the weight ``Transformer.forward`` passes."""

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed

    def __call__(self, h: torch.Tensor, _weight: object = None) -> torch.Tensor:
        return packed_linear(h, self.packed)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer under ``module``, each storage counted once."""
    seen: set[int] = set()  # storages
    packed: set[int] = set()  # packed copies, by object
    tensors = [*module.parameters(), *module.buffers()]
    head = getattr(module, "head_linear", None)
    if isinstance(head, QuantHead):  # a plain attribute, not a submodule: its blocks (and dense weights) too
        tensors += [*head.linear.parameters(), *head.linear.buffers()]
    if isinstance(head, PackedHead):
        tensors.append(head.packed)
    total = 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        if t.is_mkldnn:  # a packed copy (``pack``): oneDNN's own memory, no storage to share
            if id(t) not in packed:
                packed.add(id(t))
                total += t.numel() * t.element_size()
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total
