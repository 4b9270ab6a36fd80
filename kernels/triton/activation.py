"""SwiGLU's gate: ``silu(gate) * up`` over a fused ``[..., 2 * inter]`` projection, in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferflux.kernels.contracts import check_float
from inferflux.kernels.errors import KernelError

from ._common import check_device, unit_last_stride

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * I + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :n]) * gate_up[..., n:]`` with ``n`` half the last axis."""
    check_device("silu_and_mul", gate_up)
    check_float("silu_and_mul", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise KernelError(f"silu_and_mul: last axis of {tuple(gate_up.shape)} is not even")
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    x = unit_last_stride(gate_up).reshape(-1, 2 * inter)  # a view for the usual [tokens, 2 * inter]
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, BLOCK))](x, out, inter, x.stride(0), BLOCK=BLOCK, num_warps=4)
    return out
