"""RMSNorm, and the residual add fused with it: one program normalises one row in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferflux.kernels.contracts import check_float
from inferflux.kernels.errors import KernelError

from ._common import block, check_device, unit_last_stride


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr,
    rows_inner, stride_xa, stride_xb, stride_ra, stride_rb,
    D, eps,
    BLOCK_D: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    # Rows are addressed as (outer, inner) so a [tokens, heads, head_dim] slice of a
    # fused projection (q-norm, k-norm) is read in place, without a copy.
    row = tl.program_id(0)
    a = row // rows_inner
    b = row % rows_inner
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + a.to(tl.int64) * stride_xa + b * stride_xb + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:  # r_ptr and res_out_ptr are read and written only here
        r = tl.load(r_ptr + a.to(tl.int64) * stride_ra + b * stride_rb + offs, mask=mask, other=0.0).to(tl.float32)
        # The new residual is rounded to the activation dtype before it is normalised,
        # as the unfused reference (an add in that dtype, then the norm) does.
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row.to(tl.int64) * D + offs, s, mask=mask)
        x = s.to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(out_ptr + row.to(tl.int64) * D + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """``x`` as (tensor, outer rows, inner rows, outer stride, inner stride)."""
    x = unit_last_stride(x)
    if x.dim() == 1:
        return x, 1, 1, 0, 0
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0), 0
    if x.dim() > 3:
        x = x.reshape(-1, x.shape[-2], x.shape[-1])  # a view where strides allow, else a copy
    return x, x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def norm_warps(block_d: int) -> int:
    """The warps an RMSNorm launch of ``block_d`` columns takes (compile_check compiles with the same)."""
    return 4 if block_d <= 2048 else 8


def _check(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    check_device(name, x, weight)
    check_float(name, x)
    check_float(name, weight)  # any float dtype: it is read as float32, as the reference reads it
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise KernelError(f"{name}: weight of shape {tuple(weight.shape)} for rows of {x.shape[-1]}")
    weight_stride = weight.stride(0) if weight.numel() > 1 else 1
    if weight_stride != 1:
        raise KernelError(f"{name}: weight must be contiguous")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last axis of ``x`` (any leading shape, views allowed) in float32."""
    _check("rms_norm", x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    src, outer, inner, sa, sb = _rows(x)
    D = x.shape[-1]
    bd = block(D)
    _rms_norm_kernel[(outer * inner,)](
        src, src, weight, out, out, inner, sa, sb, 0, 0, D, eps,
        BLOCK_D=bd, ADD_RESIDUAL=False, num_warps=norm_warps(bd),
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + x`` then its RMS norm, in one pass; returns (normalised, new residual).

    Neither input is modified (the reference's semantics); both outputs are new tensors.
    """
    _check("add_rms_norm", x, weight)
    check_device("add_rms_norm", x, residual)
    check_float("add_rms_norm", x, residual)
    if x.shape != residual.shape:
        raise KernelError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out, new_residual
    xs, outer, inner, sxa, sxb = _rows(x)
    rs, _, _, sra, srb = _rows(residual)
    D = x.shape[-1]
    bd = block(D)
    _rms_norm_kernel[(outer * inner,)](
        xs, rs, weight, out, new_residual, inner, sxa, sxb, sra, srb, D, eps,
        BLOCK_D=bd, ADD_RESIDUAL=True, num_warps=norm_warps(bd),
    )
    return out, new_residual
