"""Argument checks shared by the Triton kernel wrappers.

Checks read only shapes, dtypes and devices (host-side metadata): checking index
*values* (slots, block tables) would cost a device synchronisation per layer, so
those are trusted to come from the engine's block manager.
"""

from __future__ import annotations

import os

import torch
import triton

from backends.base import BackendError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Triton makes a kernel compiled or interpreted when @triton.jit runs, which is when
# this package is imported (this module first): later changes of TRITON_INTERPRET
# do not change the kernels, so neither may they change the checks.
try:
    from triton import knobs  # Triton >= 3.4

    INTERPRETING = bool(knobs.runtime.interpret)
except ImportError:  # older Triton reads the variable itself
    INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when the kernels run under Triton's interpreter (CPU tensors, numpy execution)."""
    return INTERPRETING


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """All tensors on one device that can run the kernels."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise BackendError(f"{name}: tensors are on different devices ({device} and {t.device})")
    if device.type == "cpu" and not interpreting():
        raise BackendError(
            f"{name}: the Triton kernels need a CUDA or ROCm device; to run them on the CPU (slowly, "
            "for tests) set TRITON_INTERPRET=1 before kernels.triton is first imported"
        )


def check_float(name: str, *tensors: torch.Tensor) -> None:
    """Same floating dtype everywhere, one the kernels are written for."""
    dtype = tensors[0].dtype
    if dtype not in FLOAT_DTYPES:
        raise BackendError(f"{name}: unsupported dtype {dtype} (float32, float16 or bfloat16)")
    for t in tensors[1:]:
        if t.dtype != dtype:
            raise BackendError(f"{name}: tensors must share a dtype ({dtype} and {t.dtype})")


def block(n: int, least: int = 1) -> int:
    """The power-of-two tile covering ``n`` (tl.arange needs a power of two)."""
    return max(least, triton.next_power_of_2(n))


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last axis is contiguous (views keep their strides), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()
