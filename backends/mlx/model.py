"""The decoder-only transformer (llama, qwen2, qwen3) in MLX.

The same model as ``backends/cpu/model.py``: one forward runs a flattened batch of
tokens from many sequences, and attention reads earlier context through the paged
cache, so prefill chunks, decode steps and multi-token (speculative) verification
share one path. MLX arrays are immutable values: writing the cache is an indexed
assignment that MLX turns into a scatter, done in place when nothing else holds the
old buffer (the backend keeps exactly one reference to each cache array).

Apple silicon: custom kernels through ``mx.fast.metal_kernel`` come in where they
beat the built-ins. ``metal_kernels.py`` has a paged decode attention that reads
blocks in place, as kernels/cpu does on the host; it is off by default (switch:
``INFERFLUX_MLX_METAL_KERNELS=1``, Metal only) until measured against the built-in
path on a Mac. mlx's Linux CPU build has no Metal, so there the built-ins
(``mx.fast.rms_norm``, ``mx.fast.rope``, ``mx.fast.scaled_dot_product_attention``)
serve every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import mlx.core as mx
import numpy as np

from inferflux.backends.mlx.metal_kernels import PagedDecodeAttention, metal_kernels_enabled
from inferflux.backends.models import layout

if TYPE_CHECKING:
    from inferflux.backends.models import ModelConfig

KVCache = list[tuple[mx.array, mx.array]]  # per layer: k, v [kv_heads, num_blocks, block_size, head_dim]


@dataclass
class DecodeGroup:
    """Every single-token slice of the step, attended together over padded block tables."""

    rows: mx.array | None  # batch rows of these tokens; None when they are the whole batch
    tables: mx.array  # [D, max_blocks]; padding names block 0 and is masked out
    mask: mx.array  # [D, 1, 1, max_blocks * block_size], True where a position may be seen
    lengths: mx.array | None = None  # [D] int32 context lengths: the Metal kernel's mask


@dataclass
class PrefillGroup:
    """One sequence's run of new tokens ``[start, end)`` in the batch."""

    start: int
    end: int
    table: mx.array | None  # [num_blocks] when the run continues cached context; None: fresh
    mask: mx.array | None  # [1, 1, n, num_blocks * block_size] when not fresh


@dataclass
class StepMetadata:
    """Everything attention needs about the batch, built once per step on the host."""

    positions: mx.array  # [T] int32: RoPE offset of every new token
    slot_blocks: mx.array  # [T] physical block of every new token
    slot_offsets: mx.array  # [T] offset inside that block
    decode: DecodeGroup | None
    prefills: list[PrefillGroup]
    # Attention outputs are computed group by group (decodes, then each prefill);
    # this reorders them into batch rows, None when they already are in order.
    row_order: mx.array | None


@dataclass
class Layer:
    """One layer's weights, a field per role of backends/models/layout.py (None: a
    weight this model, or this checkpoint, does not have)."""

    # Projections are stored transposed, [in, out], and contiguous: mlx's CPU gemm
    # ran 3-4x faster on a contiguous right operand than on the transposed view of
    # an [out, in] weight (measured on the 2-core CI machine, float32).
    qkv: mx.array  # q, k and v fused: [hidden, (heads + 2 * kv_heads) * head_dim]
    o_proj: mx.array
    gate_up: mx.array  # gate and up fused: [hidden, 2 * intermediate]
    down: mx.array
    input_norm: mx.array
    post_attention_norm: mx.array
    q_norm: mx.array | None = None
    k_norm: mx.array | None = None
    qkv_bias: mx.array | None = None
    o_proj_bias: mx.array | None = None
    gate_up_bias: mx.array | None = None
    down_bias: mx.array | None = None


_LAYER_FIELDS = frozenset(Layer.__dataclass_fields__)


class Transformer:
    def __init__(self, cfg: ModelConfig, dtype: mx.Dtype) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # The custom Metal decode kernel (metal_kernels.py) is off unless Metal is
        # there and INFERFLUX_MLX_METAL_KERNELS=1: custom kernels replace built-ins
        # only where they beat them, which is still to be measured on a Mac.
        self.paged_decode = PagedDecodeAttention() if metal_kernels_enabled() else None
        # mx.fast.rope takes periods (1 / inverse frequency) through ``freqs``; using
        # ModelConfig's inverse frequencies covers every rope scaling kind at once.
        self.rope_periods = mx.array((1.0 / cfg.rope_inv_freq()).astype(np.float32))
        self.embed: mx.array | None = None  # [vocab, hidden]
        self.head: mx.array | None = None  # [hidden, vocab]
        self.norm: mx.array | None = None
        self.layers: list[Layer] = []

    # -- the step ------------------------------------------------------------------

    def __call__(self, ids: mx.array, meta: StepMetadata, caches: KVCache, logits_rows: mx.array) -> mx.array:
        # Only the rows whose logits were asked for go through the final norm and
        # the (large) output projection.
        return (self.hidden_states(ids, meta, caches, logits_rows) @ self.head).astype(mx.float32)

    def hidden_states(self, ids: mx.array, meta: StepMetadata, caches: KVCache | None,
                      rows: mx.array | None = None) -> mx.array:  # fmt: skip
        """The final hidden states (after the final norm) of the batch rows ``rows`` (None: every row).

        ``caches`` None runs without a cache, for a batch of fresh prefills only
        (embeddings), leaving the paged cache of running sequences untouched.
        """
        eps = self.cfg.rms_norm_eps
        x = self.embed[ids]
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, caches if caches is not None else [(None, None)] * len(self.layers)):
            residual = x if residual is None else residual + x
            h = mx.fast.rms_norm(residual, layer.input_norm, eps)
            h = self._attention(layer, h, meta, k_cache, v_cache)
            residual = residual + h
            h = mx.fast.rms_norm(residual, layer.post_attention_norm, eps)
            gate, up = mx.split(_linear(h, layer.gate_up, layer.gate_up_bias), 2, axis=-1)
            x = _linear(gate * mx.sigmoid(gate) * up, layer.down, layer.down_bias)
        final = residual + x if rows is None else residual[rows] + x[rows]
        return mx.fast.rms_norm(final, self.norm, eps)

    def _attention(self, w: Layer, x: mx.array, meta: StepMetadata, k_cache: mx.array | None,
                   v_cache: mx.array | None) -> mx.array:  # fmt: skip
        cfg = self.cfg
        T, heads, kv_heads, dim = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = _linear(x, w.qkv, w.qkv_bias)
        q = qkv[:, : self.q_size].reshape(T, heads, dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(T, kv_heads, dim)
        v = qkv[:, self.q_size + self.kv_size :].reshape(T, kv_heads, dim)
        if w.q_norm is not None:
            q = mx.fast.rms_norm(q, w.q_norm, cfg.rms_norm_eps)
            k = mx.fast.rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        q, k = self._rope(q, meta.positions), self._rope(k, meta.positions)

        # Index assignment updates the Python objects the backend holds, in place.
        if k_cache is not None and v_cache is not None:  # None: a step that keeps no KV (embeddings)
            k_cache[:, meta.slot_blocks, meta.slot_offsets] = k.transpose(1, 0, 2)
            v_cache[:, meta.slot_blocks, meta.slot_offsets] = v.transpose(1, 0, 2)

        outs: list[mx.array] = []
        if meta.decode is not None:
            d = meta.decode
            qd = q if d.rows is None else q[d.rows]
            if self.paged_decode is not None and d.lengths is not None:  # reads the blocks in place
                outs.append(self.paged_decode(qd, k_cache, v_cache, d.tables, d.lengths, self.scale))
            else:
                kd, vd = _gather(k_cache, d.tables), _gather(v_cache, d.tables)
                od = mx.fast.scaled_dot_product_attention(qd[:, :, None], kd, vd, scale=self.scale, mask=d.mask)
                outs.append(od[:, :, 0])
        for p in meta.prefills:
            qp = q[p.start : p.end].transpose(1, 0, 2)[None]
            if p.table is None:  # from position 0: the new tokens are the whole context
                kp = k[p.start : p.end].transpose(1, 0, 2)[None]
                vp = v[p.start : p.end].transpose(1, 0, 2)[None]
                op = mx.fast.scaled_dot_product_attention(qp, kp, vp, scale=self.scale, mask="causal")
            else:
                kp, vp = _gather(k_cache, p.table[None]), _gather(v_cache, p.table[None])
                op = mx.fast.scaled_dot_product_attention(qp, kp, vp, scale=self.scale, mask=p.mask)
            outs.append(op[0].transpose(1, 0, 2))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        if meta.row_order is not None:
            out = out[meta.row_order]
        return _linear(out.reshape(T, self.q_size), w.o_proj, w.o_proj_bias)

    def _rope(self, x: mx.array, positions: mx.array) -> mx.array:
        """Rotate ``[T, heads, head_dim]`` tokens, each at its own position.

        Each token is its own batch entry of one position (``[T, heads, 1, dim]``), so
        the vector ``offset`` gives every token its position. ``traditional=False`` is
        the half-split (``rotate_half``) convention: the GGUF loader un-permutes llama
        q/k rows into Hugging Face's layout, which rotates dimension ``i`` with
        ``i + head_dim / 2``; ``traditional=True`` would rotate adjacent pairs, which
        is what the permuted GGUF layout would need (tests/backends/mlx checks this
        against kernels.reference.apply_rope).
        """
        out = mx.fast.rope(
            x[:, :, None], self.cfg.head_dim, traditional=False, base=None, scale=1.0,
            offset=positions, freqs=self.rope_periods,
        )
        return out[:, :, 0]

    # -- weights -------------------------------------------------------------------

    def load_weights(self, tensors: Iterable[tuple[str, np.ndarray]]) -> None:
        """Take canonical (Hugging Face named) tensors, fused as backends/models/layout.py says.

        Tensors stream in one at a time and each weight is materialised as soon as its
        parts are in, so at most about one layer's numpy parts are held at once. Raises
        ``ValueError`` naming a tensor that is unknown, misshapen or missing.
        """
        weights: dict[str, mx.array] = {}
        layers: list[dict[str, mx.array]] = [{} for _ in range(self.cfg.num_layers)]
        for dest, array in layout.assemble(self.cfg, tensors):
            if array.ndim == 2 and dest.role != "embed":  # projections are kept [in, out]
                array = array.T
            weight = mx.array(np.ascontiguousarray(array)).astype(self.dtype)
            mx.eval(weight)  # materialise now, so the numpy parts can go
            if dest.layer is None:
                weights[dest.role] = weight
            elif dest.role in _LAYER_FIELDS:
                layers[dest.layer][dest.role] = weight
            else:
                raise ValueError(f"the mlx backend has no place for a layer's {dest.role} ({dest.names[0]})")
        self.embed, self.norm = weights["embed"], weights["norm"]
        self.head = weights["head"] if "head" in weights else mx.contiguous(self.embed.T)
        mx.eval(self.head)
        self.layers = [Layer(**fields) for fields in layers]


def _linear(x: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    """``x @ weight`` (weights are stored ``[in, out]``), plus ``bias`` where the checkpoint has one."""
    return x @ weight if bias is None else mx.addmm(bias, x, weight)


def _gather(cache: mx.array, tables: mx.array) -> mx.array:
    """Whole blocks of ``tables`` ``[S, max_blocks]`` as ``[S, kv_heads, max_blocks * block_size, head_dim]``."""
    kv_heads, _, block_size, dim = cache.shape
    num_seqs, max_blocks = tables.shape
    blocks = cache[:, tables]  # [kv_heads, S, max_blocks, block_size, dim]
    return blocks.transpose(1, 0, 2, 3, 4).reshape(num_seqs, kv_heads, max_blocks * block_size, dim)
