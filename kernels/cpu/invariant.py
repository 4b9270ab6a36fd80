"""The batch-invariant kernel set: ``kernels.reference``'s functions, with every
reduction in an order that depends on nothing but the row being reduced.

What the CPU backend's deterministic mode runs (``Transformer.use_invariant_kernels``):

- ``linear`` / ``linear_module``: dense projections and the output head through
  ``invariant_linear`` (invariant.cpp), one thread and one fixed order over K per output
  element, instead of a library GEMM whose split of K follows the batch's size;
- ``rms_norm`` / ``add_rms_norm``: each row in float32 in the same fixed order;
- ``paged_attention``: the C++ kernel, which owns each (sequence, KV head), walks the
  context front to back in float32 and treats each query row on its own; the model
  sends every query through it in this mode (prefill, decode, verification);
- the elementwise kernels (RoPE, SiLU times up, the KV store) are the reference's: each
  output element depends on its own inputs only.

Import it after ``kernels.cpu.load()`` succeeded; the functions raise otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from inferflux.kernels import cpu
from inferflux.kernels.reference import (  # noqa: F401  (re-exported: the rest of the kernel set)
    apply_rope,
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
    from torch import nn

paged_attention = cpu.paged_attention



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return cpu.loaded().invariant_rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` (elementwise, in the activation dtype) then normalise it."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` with a result per row that no other row can change."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != weight.dtype:
        rows = rows.to(weight.dtype)
    out = cpu.loaded().invariant_linear(rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear_module(module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward for ``module`` through ``linear``, reading its weight and bias at each call."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, module.weight, module.bias)

    return forward
