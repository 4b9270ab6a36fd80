"""Rotary embeddings, half-split and adjacent-pair, on ``[tokens, heads, head_dim]``.

One program rotates every head of one token: the token's cos/sin row is loaded
once and broadcast over the heads. ``x`` may be a view (q and k as a slice of a
fused qkv projection): its token and head strides are honoured, only the last
axis must be contiguous (else it is copied). The output is a new contiguous
tensor, as the reference's is. Arithmetic is float32 with one rounding at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferflux.kernels.contracts import check_float
from inferflux.kernels.errors import KernelError

from ._common import block, check_device, unit_last_stride


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    H, HALF,
    stride_xt, stride_xh, stride_ct,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < H) & (offs_i[None, :] < HALF)
    # Frequency i's angle is table entry i; the half-split form also reads entry
    # i + half for the second element, as the reference does (rope_cos_sin makes
    # both halves equal, other tables need not).
    c1 = tl.load(cos_ptr + t * stride_ct + offs_i, mask=offs_i < HALF, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_ct + offs_i, mask=offs_i < HALF, other=0.0).to(tl.float32)[None, :]
    if INTERLEAVED:
        first = 2 * offs_i  # pair (2i, 2i + 1)
        second = 2 * offs_i + 1
        c2 = c1
        s2 = s1
    else:
        first = offs_i  # pair (i, i + half)
        second = offs_i + HALF
        c2 = tl.load(cos_ptr + t * stride_ct + second, mask=offs_i < HALF, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + t * stride_ct + second, mask=offs_i < HALF, other=0.0).to(tl.float32)[None, :]
    row = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh
    x1 = tl.load(row + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + second[None, :], mask=mask, other=0.0).to(tl.float32)
    out_row = out_ptr + t * H * 2 * HALF + offs_h[:, None] * 2 * HALF
    dtype = out_ptr.dtype.element_ty
    tl.store(out_row + first[None, :], (x1 * c1 - x2 * s1).to(dtype), mask=mask)
    tl.store(out_row + second[None, :], (x2 * c2 + x1 * s2).to(dtype), mask=mask)


def _rope(name: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    check_device(name, x, cos, sin)
    check_float(name, x)
    check_float(name, cos, sin)
    if x.dim() != 3:
        raise KernelError(f"{name}: x must be [tokens, heads, head_dim], got {tuple(x.shape)}")
    T, H, D = x.shape
    if D % 2:
        raise KernelError(f"{name}: head_dim {D} is odd")
    if cos.shape != sin.shape or cos.shape[0] != T or cos.shape[-1] != D or cos.numel() != T * D:
        raise KernelError(f"{name}: cos/sin of shape {tuple(cos.shape)} for x of shape {tuple(x.shape)}")
    cos = cos.reshape(T, D)  # [T, 1, D] -> [T, D]: a view for the tables rope_cos_sin makes
    sin = sin.reshape(T, D)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    x = unit_last_stride(x)
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    _rope_kernel[(T,)](
        x, cos, sin, out, H, D // 2, x.stride(0), x.stride(1), cos.stride(0),
        INTERLEAVED=interleaved, BLOCK_H=block(H), BLOCK_HALF=block(D // 2), num_warps=4,
    )
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding; cos/sin ``[tokens, 1, head_dim]`` from ``reference.rope_cos_sin``."""
    return _rope("apply_rope", x, cos, sin, interleaved=False)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Adjacent-pair rotary embedding (GGML's "normal" mode), same tables."""
    return _rope("apply_rope_interleaved", x, cos, sin, interleaved=True)
