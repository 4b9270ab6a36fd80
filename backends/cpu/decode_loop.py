"""The C++ loop over layers for decode steps (``kernels/cpu/decode_loop.cpp``), and when it runs.

A decode step of one row is ~8 ms of kernels and ~5-12 ms of what lies between them: ~40 torch
ops a layer, each a dispatch and a temporary with Python in between. ``DecodeLoop`` packs each
layer's norms and projections once at load (the ``decode_loop`` pass) and runs every layer of a
qualifying step in one C++ call on buffers reused from step to step.

A projection is ggml blocks (``QuantLinear``: the loop runs ``qmatmul``; in the ``exact`` mode
``exact_linear`` below its ``gemm_from`` and the op its forward calls on its dense copy from there,
in the ``blocks`` mode ``exact_linear`` at every size, so such a model's loop takes steps of up to
``MAX_ROWS`` rows; there a ``StackedQuantLinear``, blocks of several types, too, each part by ``exact_linear``)
or a dense ``nn.Linear``
(``auto``, ``bf16``, ``f32``: the loop calls the op its forward calls, oneDNN's linear on the
weight packed once or ``F.linear``'s, on the same tensors). A step qualifies (``applies``) when
every batch row is a single-token decode step (no prefill chunk, no draft being verified: those
have several tokens a sequence) and there are at most ``max_rows`` rows: fewer than the
quantised projections' ``gemm_from``, so the Python path would run the same ``qmatmul`` kernel on
each of them (``hybrid``: one row; ``native``, ``int8``, ``int4``: up to 31; the dense modes: up to
``MAX_ROWS``). Everything else takes ``Transformer``'s Python path. The loop calls the kernels
the Python path calls, in the same order, so its logits are the same bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from inferflux.backends.cpu.linear import QuantLinear, StackedQuantLinear, dense_operand
from inferflux.kernels import cpu as cpu_kernels

if TYPE_CHECKING:
    from inferflux.backends.cpu.model import AttentionMetadata, Transformer

# Rows a step may have and still go through the loop (below the quantised projections' gemm_from too): the
# engine's default max_num_seqs. The loop saves a step's overhead between ops (~40 a layer) whatever its rows:
# 1 row ~80 -> ~110 tok/s, 32 streams ~690-745 -> ~775-795 tok/s engine-only with the default dense
# bfloat16 (2-core AMD EPYC, bench_offline.py, 2026-11-26).
MAX_ROWS = 64


def why_not(model: Transformer) -> str | None:
    """Why the loop cannot run this model's decode steps (None: it can)."""
    from inferflux.kernels.cpu import fast

    if cpu_kernels.load() is None:
        return f"no C++ kernels: {cpu_kernels.load_error()}"
    if model.deterministic:
        return "deterministic mode runs the batch-invariant kernel set"
    if model.kernels is not fast:
        return "the loop runs kernels.cpu.fast's kernels, and this model runs another set"
    if model.cfg.qk_norm:
        return "q/k norms (qwen3) are not in the loop"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {model.dtype} (float32 and bfloat16 only)"
    for layer in model.layers:
        if layer.attn.paged_attention is not fast.paged_attention:
            return "a layer's decode attention is not the C++ paged attention"
        if any(isinstance(m, StackedQuantLinear) and not all(_exact_blocks_only(q) for q in m.parts)
               for m in _projections(layer)):
            return "a fused projection of several block types has a dense side (exact mode), which the loop lacks"
        if not all(isinstance(m, (QuantLinear, StackedQuantLinear)) or dense_operand(m) is not None
                   for m in _projections(layer)):
            return "a projection's forward is neither ggml blocks nor a plain or packed dense linear"
    if max_rows(model) < 1:
        return "gemm_from 1: every step's projections run the GEMM path, which the loop does not"
    return None


def max_rows(model: Transformer) -> int:
    """The most rows a step may have and go through the loop: below every quantised projection's
    gemm_from (where the Python path runs qmatmul on each of them too), at most MAX_ROWS."""
    return min([MAX_ROWS, *(p.gemm_from - 1 for layer in model.layers for m in _projections(layer)
                            for p in _blocks(m) if _exact_dense(p) is None)])


def _blocks(m: torch.nn.Module) -> list[QuantLinear]:
    """The QuantLinears of a projection: itself, a stacked one's parts, none for a dense one."""
    return list(m.parts) if isinstance(m, StackedQuantLinear) else [m] if isinstance(m, QuantLinear) else []


def _exact_blocks_only(p: QuantLinear) -> bool:
    """Whether ``p`` multiplies its blocks by exact_linear at every row count (the blocks mode)."""
    return p.exact and not p.deterministic and _exact_dense(p) is None


def _exact_dense(p: QuantLinear) -> torch.Tensor | None:
    """The dense weight an exact projection's forward multiplies from its gemm_from (packed or plain),
    which the loop multiplies too; None for any other QuantLinear."""
    if not p.exact or p.deterministic:
        return None
    return p.packed_dense if p.packed_dense is not None else p.dense_weight


class DecodeLoop:
    """Every layer of a qualifying decode step in one C++ call (see the module docstring)."""

    def __init__(self, model: Transformer) -> None:
        reason = why_not(model)
        if reason is not None:
            raise ValueError(f"decode loop: {reason}")
        cfg = model.cfg
        tensors: list[torch.Tensor] = []
        qtypes: list[int] = []
        exact_dense: list[torch.Tensor] = []
        exact_below: list[int] = []
        # A stacked projection (blocks of several types): empty blocks in its place, its parts listed beside.
        part_weights: list[torch.Tensor] = []
        part_qtypes: list[int] = []
        part_of: list[int] = []
        empty = torch.empty(0, dtype=model.dtype)
        for layer in model.layers:
            projections = _projections(layer)
            tensors += [layer.input_norm.detach(), layer.post_attention_norm.detach()]
            tensors += [torch.empty(0, 0, dtype=torch.uint8) if isinstance(p, StackedQuantLinear)
                        else p.blocks if isinstance(p, QuantLinear) else dense_operand(p) for p in projections]
            tensors += [_bias(p, empty).to(model.dtype) for p in projections]
            qtypes += [p.qtype if isinstance(p, QuantLinear) else 0 for p in projections]
            for p in projections:
                first = _blocks(p)[0] if _blocks(p) else None
                exact = first is not None and first.exact and not first.deterministic
                dense = _exact_dense(first) if exact else None
                exact_dense.append(empty if dense is None else dense)  # empty: the blocks mode, nothing dense
                exact_below.append(first.gemm_from if exact else 0)
                if isinstance(p, StackedQuantLinear):
                    part_weights += [q.blocks for q in p.parts]
                    part_qtypes += [q.qtype for q in p.parts]
                    part_of += [len(exact_below) - 1] * len(p.parts)
        attn = model.layers[0].attn
        self._loop = cpu_kernels.loaded().DecodeLoop(
            tensors, qtypes, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, attn.scale,
            exact_dense, exact_below, part_weights, part_qtypes, part_of)
        self.max_rows = max_rows(model)

    def applies(self, meta: AttentionMetadata, rows: int) -> bool:
        """Whether a step of ``rows`` rows with this metadata runs through the loop."""
        return (not meta.prefills and isinstance(meta.decode_rows, slice) and 1 <= rows <= self.max_rows
                and meta.decode_tables is not None)

    def run(self, x: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states and residual after the last layer (the loop's buffers: valid until its next step)."""
        k_caches = [k for k, _ in kv_caches]
        v_caches = [v for _, v in kv_caches]
        x, residual = self._loop.step(x.contiguous(), k_caches, v_caches, meta.slots, meta.cos, meta.sin,
                                      meta.decode_tables, meta.decode_lens, meta.decode_starts)
        return x, residual


def _bias(p: torch.nn.Module, empty: torch.Tensor) -> torch.Tensor:
    """A projection's bias (a stacked one's: its parts' side by side), or ``empty``."""
    biases = [q.bias for q in p.parts] if isinstance(p, StackedQuantLinear) else [p.bias]
    if all(b is None for b in biases):
        return empty
    return torch.cat([b.detach() for b in biases])


def _projections(layer: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down]
