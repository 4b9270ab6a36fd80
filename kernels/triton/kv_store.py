"""Write new keys and values into the paged cache, one program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferflux.kernels.contracts import check_store_kv

from ._common import block, check_cache_strides, check_device, unit_last_stride


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    KVH, D, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ch, stride_cb, stride_cs,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:  # a negative slot marks a padding token: nothing to write
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < KVH) & (offs_d[None, :] < D)
        # Both caches share one layout [kv_heads, num_blocks, block_size, head_dim].
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
        dst = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write ``k``/``v`` ``[tokens, kv_heads, head_dim]`` (views allowed) into their cache slots.

    Slots are not range-checked (that would synchronise with the device every
    layer); a negative slot is skipped, so padded batches can name no slot.
    """
    check_device("store_kv", k_cache, v_cache, k, v, slots)
    check_store_kv(k_cache, v_cache, k, v, slots)
    check_cache_strides("store_kv", k_cache, v_cache)
    kv_heads, _, block_size, head_dim = k_cache.shape
    T = slots.shape[0]
    if T == 0:
        return
    k, v, slots = unit_last_stride(k), unit_last_stride(v), slots.contiguous()
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slots, kv_heads, head_dim, block_size,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_H=block(kv_heads), BLOCK_D=block(head_dim), num_warps=4,
    )
