"""The CPU backend's default kernel set: ``kernels.reference``'s functions, with the
compiled ones of this package where they are faster (``fused.cpp``: residual add +
RMSNorm, RoPE on q and k; ``paged_attention.cpp``: decode attention over the paged cache).

``fused_silu_and_mul`` is built and tested but not in this set yet: its exp is scalar
(no vector math library in the extension's build), and at one row it measured slower
(24.6 against 19.8 us under load) than torch's SiLU, which uses a vectorised exp.

At batch 1 a decode step is mostly small elementwise ops, and each PyTorch op costs its
dispatch and a temporary whatever its size: one fused call replaces the 6 to 9 ops of
each of these per layer (benchmarks/bench_step_overhead.py measures it). RoPE rounds
where the reference does (the same bits); the norms reduce each row in float32 in one
fixed order, within rounding of the reference and independent of the batch.

Import it after ``kernels.cpu.load()`` succeeded; the functions raise otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferflux.kernels import cpu
from inferflux.kernels.reference import (  # noqa: F401  (re-exported: the rest of the kernel set)
    apply_rope_interleaved,
    attention_mask,
    causal_attention,
    context_mask,
    rope_cos_sin,
    silu_and_mul,
    store_kv,
)

if TYPE_CHECKING:
    import torch

paged_attention = cpu.paged_attention



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return cpu.loaded().fused_add_rms_norm(rows, None, weight, eps)[0].view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + x`` then normalise it; returns (normalised, new residual)."""
    h, res = cpu.loaded().fused_add_rms_norm(x, residual, weight, eps)
    return h, res


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return cpu.loaded().fused_rope(x, cos, sin)

