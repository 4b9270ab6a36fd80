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

from backends.mlx.metal_kernels import PagedDecodeAttention, metal_kernels_enabled
from backends.models.layout import expected_tensors

if TYPE_CHECKING:
    from backends.models import ModelConfig

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
    # Projections are stored transposed, [in, out], and contiguous: mlx's CPU gemm
    # ran 3-4x faster on a contiguous right operand than on the transposed view of
    # an [out, in] weight (measured on the 2-core CI machine, float32).
    qkv: mx.array  # q, k and v fused: [hidden, (heads + 2 * kv_heads) * head_dim]
    qkv_bias: mx.array | None
    o_proj: mx.array
    q_norm: mx.array | None
    k_norm: mx.array | None
    gate_up: mx.array  # gate and up fused: [hidden, 2 * intermediate]
    down: mx.array
    input_norm: mx.array
    post_attention_norm: mx.array


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
        eps = self.cfg.rms_norm_eps
        x = self.embed[ids]
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            residual = x if residual is None else residual + x
            h = mx.fast.rms_norm(residual, layer.input_norm, eps)
            h = self._attention(layer, h, meta, k_cache, v_cache)
            residual = residual + h
            h = mx.fast.rms_norm(residual, layer.post_attention_norm, eps)
            gate, up = mx.split(h @ layer.gate_up, 2, axis=-1)
            x = (gate * mx.sigmoid(gate) * up) @ layer.down
        # Only the rows whose logits were asked for go through the final norm and
        # the (large) output projection.
        h = mx.fast.rms_norm(residual[logits_rows] + x[logits_rows], self.norm, eps)
        return (h @ self.head).astype(mx.float32)

    def _attention(self, w: Layer, x: mx.array, meta: StepMetadata, k_cache: mx.array, v_cache: mx.array) -> mx.array:
        cfg = self.cfg
        T, heads, kv_heads, dim = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = x @ w.qkv
        if w.qkv_bias is not None:
            qkv = qkv + w.qkv_bias
        q = qkv[:, : self.q_size].reshape(T, heads, dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(T, kv_heads, dim)
        v = qkv[:, self.q_size + self.kv_size :].reshape(T, kv_heads, dim)
        if w.q_norm is not None:
            q = mx.fast.rms_norm(q, w.q_norm, cfg.rms_norm_eps)
            k = mx.fast.rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        q, k = self._rope(q, meta.positions), self._rope(k, meta.positions)

        # Index assignment updates the Python objects the backend holds, in place.
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
        return out.reshape(T, self.q_size) @ w.o_proj

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
        """Take canonical (Hugging Face named) tensors, fusing q/k/v and gate/up.

        Tensors stream in one at a time; a fused weight is built once all of its
        parts have arrived, so at most one layer's parts are held at once.
        """
        destinations = self._destinations()
        owner = {name: key for key, names in destinations.items() for name in names}
        required, optional = expected_tensors(self.cfg)
        parts: dict[str, dict[str, np.ndarray]] = {}
        weights: dict[str, mx.array] = {}
        for name, array in tensors:
            if name in optional:  # o_proj / MLP biases: not built yet, as in the cpu backend
                raise ValueError(f"tensor {name} is not supported by the mlx backend")
            if name not in owner:
                raise ValueError(f"unexpected tensor in model file: {name}")
            if tuple(array.shape) != required[name]:
                raise ValueError(f"{name}: shape {tuple(array.shape)} != expected {required[name]}")
            key = owner[name]
            got = parts.setdefault(key, {})
            got[name] = array
            names = destinations[key]
            if len(got) == len(names):
                fused = np.concatenate([got[n] for n in names], axis=0) if len(names) > 1 else got[names[0]]
                if fused.ndim == 2 and key != "embed":  # projections are kept [in, out]
                    fused = fused.T
                weights[key] = mx.array(np.ascontiguousarray(fused)).astype(self.dtype)
                mx.eval(weights[key])  # materialise now, so the numpy parts can go
                del parts[key]
        missing = sorted(n for key, names in destinations.items() if key not in weights for n in names)
        if missing:
            raise ValueError(f"model file lacks tensors: {missing[:8]}")
        self.embed, self.norm = weights["embed"], weights["norm"]
        self.head = weights["head"] if "head" in weights else mx.contiguous(self.embed.T)
        mx.eval(self.head)
        for i in range(self.cfg.num_layers):
            w = {name: weights.get(f"{i}.{name}") for name in Layer.__dataclass_fields__}
            self.layers.append(Layer(**w))

    def _destinations(self) -> dict[str, tuple[str, ...]]:
        """Each weight's key with the canonical tensor names concatenated into it."""
        cfg = self.cfg
        out: dict[str, tuple[str, ...]] = {
            "embed": ("model.embed_tokens.weight",),
            "norm": ("model.norm.weight",),
        }
        if not cfg.tie_word_embeddings:
            out["head"] = ("lm_head.weight",)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = tuple(f"{p}self_attn.{n}_proj" for n in "qkv")
            out[f"{i}.qkv"] = tuple(n + ".weight" for n in qkv)
            if cfg.attention_bias:
                out[f"{i}.qkv_bias"] = tuple(n + ".bias" for n in qkv)
            out[f"{i}.o_proj"] = (p + "self_attn.o_proj.weight",)
            if cfg.qk_norm:
                out[f"{i}.q_norm"] = (p + "self_attn.q_norm.weight",)
                out[f"{i}.k_norm"] = (p + "self_attn.k_norm.weight",)
            out[f"{i}.gate_up"] = (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            out[f"{i}.down"] = (p + "mlp.down_proj.weight",)
            out[f"{i}.input_norm"] = (p + "input_layernorm.weight",)
            out[f"{i}.post_attention_norm"] = (p + "post_attention_layernorm.weight",)
        return out

def _gather(cache: mx.array, tables: mx.array) -> mx.array:
    """Whole blocks of ``tables`` ``[S, max_blocks]`` as ``[S, kv_heads, max_blocks * block_size, head_dim]``."""
    kv_heads, _, block_size, dim = cache.shape
    num_seqs, max_blocks = tables.shape
    blocks = cache[:, tables]  # [kv_heads, S, max_blocks, block_size, dim]
    return blocks.transpose(1, 0, 2, 3, 4).reshape(num_seqs, kv_heads, max_blocks * block_size, dim)
