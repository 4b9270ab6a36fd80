"""Triton kernels for the CUDA backend (the same source runs on ROCm).

A drop-in *kernel set*: every function has the name, signature and semantics of
its counterpart in ``kernels.reference``, which is also the test oracle.

- ``rms_norm``, ``add_rms_norm``: one program per row, float32 statistics; the
  residual add is fused into the norm.
- ``apply_rope`` (half-split), ``apply_rope_interleaved`` (adjacent pairs): one
  program per token, q/k may be strided views of a fused projection.
- ``silu_and_mul``: SwiGLU's gate over a fused gate/up projection.
- ``store_kv``: new keys/values into their paged cache slots, in place.
- ``paged_attention``: causal attention over the paged cache with online
  softmax, for decode steps, prefill chunks and draft verification, with GQA.
- ``causal_attention``: the reference's own (PyTorch SDPA, which dispatches to
  flash attention on the GPU) - no Triton kernel of ours would beat it.

All arithmetic is float32 with one rounding to the activation dtype at the end.
Wrappers check shapes, dtypes and devices (``kernels.contracts`` for the checks every
kernel set shares) and raise ``kernels.errors.KernelError``; index values (slots,
block tables) are trusted, since checking them would synchronise with the device
every layer.

To run the kernels on the CPU (tests, no GPU), set ``TRITON_INTERPRET=1`` before this
package is first imported: Triton decides at definition time whether a kernel is
compiled or interpreted. ``python -m kernels.triton.compile_check`` compiles every
kernel for CUDA (sm_80, sm_90) and ROCm (gfx942) targets without a GPU.
"""

from inferflux.kernels.reference import causal_attention

from .activation import silu_and_mul
from .kv_store import store_kv
from .norm import add_rms_norm, rms_norm
from .paged_attention import paged_attention
from .rope import apply_rope, apply_rope_interleaved

__all__ = [
    "add_rms_norm",
    "apply_rope",
    "apply_rope_interleaved",
    "causal_attention",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]
