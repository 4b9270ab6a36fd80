"""Custom Metal kernels for the MLX backend, through ``mx.fast.metal_kernel``.

One kernel so far: paged decode attention. It reads K and V in place from the paged
cache through each sequence's block table, where the built-in path first gathers
every block of every decode sequence into a padded copy for
``mx.fast.scaled_dot_product_attention``. Each decode row is one query token of one
sequence; layouts are those of kernels/reference.py:

- q and the output: ``[D, heads, head_dim]`` in the activation dtype;
- k_cache, v_cache: ``[kv_heads, num_blocks, block_size, head_dim]``;
- tables: ``[D, max_blocks]`` int32, padded with any valid block (never read);
- lengths: ``[D]`` int32, positions ``0 .. length - 1`` are visible.

The kernel is off by default and only ever runs on Apple silicon with Metal, with
``INFERFLUX_MLX_METAL_KERNELS=1``: model.py's rule is that custom kernels replace the
built-ins only where they beat them, and that has to be measured on a Mac (not done
yet; mlx's Linux build has no Metal). ``paged_decode_attention_reference`` computes
the same thing with mx ops on any device: the kernel's oracle on a Mac.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx

from inferflux.backends.base import BackendError

ENV_SWITCH = "INFERFLUX_MLX_METAL_KERNELS"

# Apple GPUs run 32-wide SIMD groups; one threadgroup is exactly one of them, so a
# dot product is one simd_sum and no threadgroup memory or barrier is needed.
SIMD_WIDTH = 32
# Each thread keeps ceil(head_dim / 32) query and accumulator values in registers.
MAX_HEAD_DIM = 256

INPUT_NAMES = ("q", "k_cache", "v_cache", "tables", "lengths", "scale")
OUTPUT_NAMES = ("out",)

# Template arguments fixed for a loaded model (so each model compiles the kernel
# once). max_blocks changes from step to step, so it is read at run time from
# ``tables_shape`` instead: a template value would compile a new kernel per value.
TEMPLATE_NAMES = ("T", "HEADS", "KV_HEADS", "HEAD_DIM", "BLOCK_SIZE", "NUM_BLOCKS")

HEADER = """
#include <metal_stdlib>
using namespace metal;
"""

# The body only: mx.fast.metal_kernel writes the signature from INPUT_NAMES,
# OUTPUT_NAMES, the input dtypes and the attributes the body names
# (threadgroup_position_in_grid, thread_index_in_simdgroup, tables_shape).
SOURCE = """
    // One threadgroup (one SIMD group) per (sequence, head): grid (32, heads, D).
    const uint seq = threadgroup_position_in_grid.z;
    const uint head = threadgroup_position_in_grid.y;
    const uint lane = thread_index_in_simdgroup;
    // GQA: query head h reads KV head h / (HEADS / KV_HEADS).
    const ulong kv_head = head / (HEADS / KV_HEADS);
    const ulong max_blocks = ulong(tables_shape[1]);
    const int length = lengths[seq];
    constexpr int PER_LANE = (HEAD_DIM + 31) / 32;

    // The lanes split head_dim: lane i owns dimensions i, i + 32, ...
    const device T* q_row = q + (ulong(seq) * HEADS + head) * HEAD_DIM;
    float qv[PER_LANE];
    float acc[PER_LANE];
    for (int i = 0; i < PER_LANE; ++i) {
        const int d = int(lane) + 32 * i;
        qv[i] = d < HEAD_DIM ? float(q_row[d]) * scale[0] : 0.0f;
        acc[i] = 0.0f;
    }

    // Online softmax in float32: running max m, running sum l, unnormalised acc,
    // rescaled whenever m grows. A finite start keeps exp() well defined even if
    // the kernel is compiled with fast math.
    float m = -1.0e30f;
    float l = 0.0f;
    const device int* table = tables + ulong(seq) * max_blocks;
    for (int pos = 0; pos < length; ++pos) {
        const ulong block = ulong(table[pos / BLOCK_SIZE]);
        const ulong base = ((kv_head * NUM_BLOCKS + block) * BLOCK_SIZE + ulong(pos % BLOCK_SIZE)) * HEAD_DIM;
        float partial = 0.0f;
        for (int i = 0; i < PER_LANE; ++i) {
            const int d = int(lane) + 32 * i;
            if (d < HEAD_DIM) {
                partial += qv[i] * float(k_cache[base + d]);
            }
        }
        const float score = simd_sum(partial);  // every lane gets the whole dot product
        const float m_new = metal::max(m, score);
        const float rescale = metal::exp(m - m_new);
        const float p = metal::exp(score - m_new);
        l = l * rescale + p;
        for (int i = 0; i < PER_LANE; ++i) {
            const int d = int(lane) + 32 * i;
            const float v = d < HEAD_DIM ? float(v_cache[base + d]) : 0.0f;
            acc[i] = acc[i] * rescale + p * v;
        }
        m = m_new;
    }

    // A row with no visible position (never a decode row) gets zeros, not NaN.
    const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
    device T* out_row = out + (ulong(seq) * HEADS + head) * HEAD_DIM;
    for (int i = 0; i < PER_LANE; ++i) {
        const int d = int(lane) + 32 * i;
        if (d < HEAD_DIM) {
            out_row[d] = static_cast<T>(acc[i] * inv_l);
        }
    }
"""


def metal_kernels_enabled() -> bool:
    """True only with Metal available *and* ``INFERFLUX_MLX_METAL_KERNELS=1``.

    Off by default: the custom kernel is to replace the built-in attention only where
    it is measured to beat it on a Mac, and that measurement has not been made yet.
    """
    return os.environ.get(ENV_SWITCH, "") == "1" and mx.metal.is_available()


@dataclass(frozen=True)
class Launch:
    """Everything ``kernel(...)`` takes besides the inputs, computed on the host."""

    grid: tuple[int, int, int]  # in threads, as mlx dispatches (dispatchThreads)
    threadgroup: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[mx.Dtype]
    template: list[tuple[str, mx.Dtype | int]]


def decode_launch(num_seqs: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                  num_blocks: int, dtype: mx.Dtype) -> Launch:
    """The launch of the paged decode kernel for ``num_seqs`` decode rows (pure Python)."""
    if num_seqs < 1:
        raise BackendError(f"paged decode attention needs at least one row, got {num_seqs}")
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise BackendError(f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise BackendError(f"head_dim {head_dim} is outside the kernel's range 1..{MAX_HEAD_DIM}")
    if block_size < 1 or num_blocks < 1:
        raise BackendError(f"bad cache geometry: {num_blocks} blocks of {block_size} tokens")
    return Launch(
        grid=(SIMD_WIDTH, heads, num_seqs),
        threadgroup=(SIMD_WIDTH, 1, 1),
        output_shapes=[(num_seqs, heads, head_dim)],
        output_dtypes=[dtype],
        template=[("T", dtype), ("HEADS", heads), ("KV_HEADS", kv_heads), ("HEAD_DIM", head_dim),
                  ("BLOCK_SIZE", block_size), ("NUM_BLOCKS", num_blocks)],
    )


def _check_inputs(q: mx.array, k_cache: mx.array, v_cache: mx.array, tables: mx.array,
                  lengths: mx.array) -> None:
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise BackendError(f"paged decode attention wants q [D, heads, dim] and equal caches "
                           f"[kv_heads, blocks, block_size, dim]; got {q.shape}, {k_cache.shape}, {v_cache.shape}")
    if k_cache.shape[3] != q.shape[2]:
        raise BackendError(f"head_dim of q ({q.shape[2]}) != head_dim of the cache ({k_cache.shape[3]})")
    if tables.ndim != 2 or tables.shape[0] != q.shape[0] or lengths.shape != (q.shape[0],):
        raise BackendError(f"tables {tables.shape} / lengths {lengths.shape} do not match {q.shape[0]} rows")


class PagedDecodeAttention:
    """The Metal kernel, built once (mlx compiles it on first call per template)."""

    def __init__(self) -> None:
        self.kernel = mx.fast.metal_kernel(
            name="inferflux_paged_decode_attention",
            input_names=list(INPUT_NAMES),
            output_names=list(OUTPUT_NAMES),
            source=SOURCE,
            header=HEADER,
            ensure_row_contiguous=True,  # the kernel indexes every input as dense row-major
        )

    def __call__(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, tables: mx.array,
                 lengths: mx.array, scale: float) -> mx.array:
        _check_inputs(q, k_cache, v_cache, tables, lengths)
        kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        launch = decode_launch(q.shape[0], q.shape[1], kv_heads, head_dim, block_size, num_blocks, q.dtype)
        (out,) = self.kernel(
            inputs=[q, k_cache, v_cache, tables.astype(mx.int32), lengths.astype(mx.int32),
                    mx.array([scale], dtype=mx.float32)],
            template=launch.template,
            grid=launch.grid,
            threadgroup=launch.threadgroup,
            output_shapes=launch.output_shapes,
            output_dtypes=launch.output_dtypes,
        )
        return out


def paged_decode_attention_reference(q: mx.array, k_cache: mx.array, v_cache: mx.array, tables: mx.array,
                                     lengths: mx.array, scale: float) -> mx.array:
    """What the kernel computes, with mx ops: gather the blocks, mask, softmax in float32."""
    _check_inputs(q, k_cache, v_cache, tables, lengths)
    num_seqs, heads, dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    if heads % kv_heads:
        raise BackendError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    group = heads // kv_heads
    context = tables.shape[1] * block_size

    def gather(cache: mx.array) -> mx.array:  # -> [D, kv_heads, context, dim] float32
        blocks = cache[:, tables].astype(mx.float32)  # [kv_heads, D, max_blocks, block_size, dim]
        return blocks.transpose(1, 0, 2, 3, 4).reshape(num_seqs, kv_heads, context, dim)

    k, v = gather(k_cache), gather(v_cache)
    # Query head h = kv_head * group + g, so its KV head is h // group.
    qg = q.astype(mx.float32).reshape(num_seqs, kv_heads, group, dim) * scale
    scores = qg @ k.transpose(0, 1, 3, 2)  # [D, kv_heads, group, context]
    visible = mx.arange(context)[None, :] < lengths[:, None]  # [D, context]
    scores = mx.where(visible[:, None, None, :], scores, -mx.inf)
    out = mx.softmax(scores, axis=-1) @ v  # [D, kv_heads, group, dim]
    # An empty context would give NaN (all -inf); the kernel gives zeros.
    out = mx.where((lengths > 0)[:, None, None, None], out, 0.0)
    return out.reshape(num_seqs, heads, dim).astype(q.dtype)
