"""The argument checks that every kernel set with checks of its own in Python shares.

``kernels.reference`` defines what each kernel takes and returns; the Triton and Metal
sets check their arguments against it before they launch, with these functions, so the
same mistake gets the same ``KernelError`` from either. What only one set needs stays
with it: Triton's device and stride checks, Metal's contiguity and head_dim limit. The
C++ CPU kernel checks in C++ (``TORCH_CHECK``), where it reads raw pointers, and the
reference relies on PyTorch's own errors.

Checks read only shapes and dtypes (host-side metadata): checking index *values*
(slots, block tables) would cost a device synchronisation per layer, so those are
trusted to come from the engine's block manager.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from inferflux.kernels.errors import KernelError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class PagedAttentionShape:
    """The sizes of one checked ``paged_attention`` call."""

    num_seqs: int
    q_len: int
    heads: int
    head_dim: int
    kv_heads: int
    num_blocks: int
    block_size: int
    max_blocks: int

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.heads // self.kv_heads


def check_float(name: str, *tensors: Tensor) -> None:
    """Same floating dtype everywhere, one the kernels are written for."""
    dtype = tensors[0].dtype
    if dtype not in FLOAT_DTYPES:
        raise KernelError(f"{name}: unsupported dtype {dtype} (float32, float16 or bfloat16)")
    for t in tensors[1:]:
        if t.dtype != dtype:
            raise KernelError(f"{name}: tensors must share a dtype ({dtype} and {t.dtype})")


def check_paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                          query_start: Tensor) -> PagedAttentionShape:
    """``kernels.reference.paged_attention``'s arguments (less ``scale`` and ``mask``) fit
    together; their sizes."""
    name = "paged_attention"
    check_float(name, q, k_cache, v_cache)
    if q.dim() != 4:
        raise KernelError(f"{name}: q must be [num_seqs, q_len, heads, head_dim], got {tuple(q.shape)}")
    _check_caches(name, k_cache, v_cache)
    num_seqs, q_len, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise KernelError(f"{name}: q head_dim {head_dim} but cache head_dim {cache_dim}")
    if heads % kv_heads:
        raise KernelError(f"{name}: {heads} query heads is not a multiple of KV heads ({kv_heads})")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise KernelError(f"{name}: block_tables {tuple(block_tables.shape)} for {num_seqs} sequences")
    if context_lens.shape != (num_seqs,) or query_start.shape != (num_seqs,):
        raise KernelError(
            f"{name}: context_lens {tuple(context_lens.shape)} and query_start {tuple(query_start.shape)} "
            f"must both be [{num_seqs}]"
        )
    _check_index(name, block_tables=block_tables, context_lens=context_lens, query_start=query_start)
    return PagedAttentionShape(num_seqs, q_len, heads, head_dim, kv_heads, num_blocks, block_size,
                               block_tables.shape[1])


def check_store_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor) -> None:
    """``kernels.reference.store_kv``'s arguments fit together."""
    name = "store_kv"
    check_float(name, k_cache, v_cache, k, v)
    _check_caches(name, k_cache, v_cache)
    kv_heads, _, _, head_dim = k_cache.shape
    expected = (slots.shape[0] if slots.dim() == 1 else -1, kv_heads, head_dim)
    if slots.dim() != 1 or tuple(k.shape) != expected or tuple(v.shape) != expected:
        raise KernelError(
            f"{name}: k {tuple(k.shape)}, v {tuple(v.shape)} and slots {tuple(slots.shape)} "
            f"do not match {expected} for caches {tuple(k_cache.shape)}"
        )
    _check_index(name, slots=slots)


def _check_caches(name: str, k_cache: Tensor, v_cache: Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise KernelError(
            f"{name}: caches must be two alike [kv_heads, num_blocks, block_size, head_dim] tensors, "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


def _check_index(name: str, **tensors: Tensor) -> None:
    for what, t in tensors.items():
        if t.dtype not in INDEX_DTYPES:
            raise KernelError(f"{name}: {what} must be int32 or int64, got {t.dtype}")
