"""What the Triton kernel wrappers share: the device check, tile sizes, strides.

The checks every kernel set shares (dtypes, and the shapes of paged attention and KV
stores) are in ``kernels.contracts``. Checks read only host-side metadata; index
*values* (slots, block tables) are trusted, as ``kernels.contracts`` says why.
"""

from __future__ import annotations

import os

import torch
import triton

from inferflux.kernels.errors import KernelError

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
            raise KernelError(f"{name}: tensors are on different devices ({device} and {t.device})")
    if device.type == "cpu" and not interpreting():
        raise KernelError(
            f"{name}: the Triton kernels need a CUDA or ROCm device; to run them on the CPU (slowly, "
            "for tests) set TRITON_INTERPRET=1 before kernels.triton is first imported"
        )


def check_cache_strides(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The kernels address both caches with one set of strides and read head_dim rows whole."""
    if k_cache.stride() != v_cache.stride():
        raise KernelError(f"{name}: the caches' strides differ ({k_cache.stride()} and {v_cache.stride()})")
    if k_cache.stride(-1) != 1:
        raise KernelError(f"{name}: the caches' head_dim axis must be contiguous")


def block(n: int, least: int = 1) -> int:
    """The power-of-two tile covering ``n`` (tl.arange needs a power of two)."""
    return max(least, triton.next_power_of_2(n))


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last axis is contiguous (views keep their strides), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()
