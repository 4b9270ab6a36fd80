"""Compile every kernel for real GPU targets, ahead of time, on a machine with no GPU.

The interpreter proves what the kernels compute, not that Triton can compile them
(tile shapes ``tl.dot`` accepts, types, shared memory). Triton's compiler needs no
device: this compiles each kernel, at the tile sizes its wrapper picks for a
representative model shape, down to a CUDA cubin (Triton ships ``ptxas``) and an
AMD ``hsaco``, and prints each one's shared memory.

    python -m kernels.triton.compile_check [--target cuda:90] [--target hip:gfx942]

Run it with TRITON_INTERPRET unset: under the interpreter there is nothing to compile.
Exit code 0 when everything compiled, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

# Index arrays; every other pointer argument points at activations or the cache.
INDEX_POINTERS = {"tables_ptr", "lens_ptr", "starts_ptr", "slots_ptr"}
FLOAT_SCALARS = {"eps", "scale_log2"}
FLOAT32_POINTERS = {"part_ptr", "lse_ptr"}  # split-context shares: float32 whatever the model's dtype
DEFAULT_TARGETS = ("cuda:80", "cuda:90", "hip:gfx942")
# Shared memory (LDS) one program may use, in bytes: A100, H100, MI300.
SHARED_LIMITS = {"cuda:80": 163 * 1024, "cuda:90": 227 * 1024, "hip:gfx942": 64 * 1024}
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass
class Variant:
    module: str  # under kernels.triton
    kernel: str
    dtype: str  # Triton's name for the activation dtype: bf16, fp16, fp32
    constexprs: dict[str, Any]
    options: dict[str, int] = field(default_factory=lambda: {"num_warps": 4})
    # --quick compiles the first variant of each kernel, and those marked: a second code path
    # of one kernel (a constexpr flag that changes what it does, not only its tiles).
    quick: bool = False

    @property
    def label(self) -> str:
        flags = ", ".join(f"{k}={v}" for k, v in self.constexprs.items())
        return f"{self.kernel}[{self.dtype}; {flags}]"


def variants() -> list[Variant]:
    """Each kernel at the configurations its wrapper launches for llama-3-8B-like shapes
    (hidden 4096, 32 heads / 8 KV heads, head_dim 128, SwiGLU 14336) and head_dim 256."""
    from ._common import block
    from .activation import BLOCK
    from .norm import norm_warps
    from .paged_attention import tile_sizes

    hidden = block(4096)
    out = [
        Variant("norm", "_rms_norm_kernel", "bf16", {"BLOCK_D": hidden, "ADD_RESIDUAL": False},
                {"num_warps": norm_warps(hidden)}),
        Variant("norm", "_rms_norm_kernel", "bf16", {"BLOCK_D": hidden, "ADD_RESIDUAL": True},
                {"num_warps": norm_warps(hidden)}, quick=True),
        Variant("rope", "_rope_kernel", "bf16", {"INTERLEAVED": False, "BLOCK_H": 64, "BLOCK_HALF": 64}),
        Variant("rope", "_rope_kernel", "bf16", {"INTERLEAVED": True, "BLOCK_H": 64, "BLOCK_HALF": 64}),
        Variant("activation", "_silu_and_mul_kernel", "bf16", {"BLOCK": BLOCK}),
        Variant("kv_store", "_store_kv_kernel", "bf16", {"BLOCK_H": 8, "BLOCK_D": 128}),
    ]
    # decode at GQA group 4, verification of 5 tokens, prefill rows, float types, head_dim 256
    for dtype, q_rows, head_dim in (("bf16", 4, 128), ("bf16", 5 * 4, 128), ("bf16", 1024, 128),
                                    ("fp16", 4, 128), ("fp32", 4, 128), ("bf16", 4, 256)):
        block_m, block_n, block_d = tile_sizes(q_rows, head_dim, ELEM_BYTES[dtype])
        out.append(Variant(
            "paged_attention", "_paged_attention_kernel", dtype,
            {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d, "IEEE": dtype == "fp32", "UPCAST": False,
             "SPLIT": False},
            {"num_warps": 4, "num_stages": 2},
        ))
    # split context (flash decoding): the decode shares, and their merge
    for dtype, head_dim in (("bf16", 128), ("fp32", 128), ("bf16", 256)):
        block_m, block_n, block_d = tile_sizes(4, head_dim, ELEM_BYTES[dtype])
        out.append(Variant(
            "paged_attention", "_paged_attention_kernel", dtype,
            {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d, "IEEE": dtype == "fp32", "UPCAST": False,
             "SPLIT": True},
            {"num_warps": 4, "num_stages": 2},
        ))
        out.append(Variant("paged_attention", "_merge_shares_kernel", dtype,
                           {"BLOCK_S": 16, "BLOCK_D": block_d}, {"num_warps": 1}))
    return out


def signature(fn: Any, dtype: str, constexprs: dict[str, Any]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INDEX_POINTERS:
            sig[name] = "*i64"
        elif name in FLOAT32_POINTERS:
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        elif name in FLOAT_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def parse_target(spec: str) -> Any:
    from triton.backends.compiler import GPUTarget

    backend, _, arch = spec.partition(":")
    if backend == "cuda":
        return GPUTarget("cuda", int(arch), 32)
    if backend == "hip":
        return GPUTarget("hip", arch, 64)
    raise ValueError(f"unknown target {spec!r} (cuda:<sm> or hip:<gfx arch>)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", help=f"cuda:<sm> or hip:<gfx> (default: {DEFAULT_TARGETS})")
    parser.add_argument("--quick", action="store_true",
                        help="one configuration per kernel (paged attention: bf16 decode; the norm with "
                             "and without the residual add) instead of all")
    args = parser.parse_args(argv)

    import triton
    from triton.compiler import ASTSource

    from ._common import interpreting

    if interpreting():
        print("TRITON_INTERPRET is set: the kernels are interpreted, there is nothing to compile", file=sys.stderr)
        return 1
    failures = 0
    for spec in args.target or DEFAULT_TARGETS:
        target = parse_target(spec)
        todo = variants()
        if args.quick:
            todo = [v for i, v in enumerate(todo) if v.quick or all(w.kernel != v.kernel for w in todo[:i])]
        for v in todo:
            fn = getattr(importlib.import_module(f"{__package__}.{v.module}"), v.kernel)
            source = ASTSource(fn=fn, signature=signature(fn, v.dtype, v.constexprs), constexprs=v.constexprs)
            t0 = time.perf_counter()
            try:
                compiled = triton.compile(source, target=target, options=v.options)
            except Exception as exc:  # report every failure, not only the first
                failures += 1
                print(f"FAIL {spec:12s} {v.label}: {type(exc).__name__}: {str(exc).strip()[:2000]}")
                continue
            binary = "cubin" if target.backend == "cuda" else "hsaco"
            if binary not in compiled.asm:
                failures += 1
                print(f"FAIL {spec:12s} {v.label}: no {binary} produced")
                continue
            shared, limit = compiled.metadata.shared, SHARED_LIMITS.get(spec)
            if limit is not None and shared > limit:
                failures += 1
                print(f"FAIL {spec:12s} {v.label}: needs {shared} B of shared memory, the target has {limit} B")
                continue
            print(f"ok   {spec:12s} {v.label}: shared {shared} B, {time.perf_counter() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
