#!/usr/bin/env python3
"""The exact mode's small-batch kernel against the GEMM it stands in for (bfloat16: oneDNN's on packed
weights; float32: torch's F.linear on the dense weights).

Why: a one-row decode step of the default model is memory-bound, and its bfloat16
projections are 2 bytes a weight; ``kernels.cpu.exact_linear`` reads the GGUF file's own
blocks (Q4_1: 0.625 bytes a weight; the Q8_0 head 1.06) and decodes them in registers to
the very bfloat16 values the dense weights hold, so it multiplies the same numbers. This
measures from how many rows the packed GEMM (``backends.cpu.linear.packed_linear``, what
``bf16`` runs at every size) is as fast, which sets ``EXACT_GEMM_FROM_ROWS``.

Method: one "step" is every projection of the bundled SmolLM2-135M (30 layers of fused
qkv, o, fused gate_up, down, then the tied Q8_0 head), each with its own weights as the
``exact`` mode loads them (blocks, and the dense weights packed for oneDNN: 96 MB and
270 MB, far more than the caches, as in serving), at ``--rows`` rows of random bfloat16
activations. The two kernels alternate step by step, ``--rounds`` rounds of ``--steps``
steps each; medians. Before timing, every projection's exact result is checked bit for
bit against ``invariant_linear`` on its dense weight (the contract), at 1 and 5 rows.
``--dtype float32`` does the same in float32 (a CPU without AVX-512 BF16, where ``auto``
loads float32): the dense weights are 4 bytes a weight (539 MB), and the peer is
``F.linear`` on them, what ``f32`` runs at every size.

Usage:
    .venv/bin/python benchmarks/bench_exact_linear.py [--rows 1,2,4,8,16] [--rounds 5] [--steps 10]
        [--dtype bfloat16|float32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from inferflux.backends.base import ModelSpec  # noqa: E402
from inferflux.backends.cpu import CPUBackend  # noqa: E402
from inferflux.backends.cpu import linear as ql  # noqa: E402
from inferflux.backends.models import default_model_path  # noqa: E402
from bench_packed_linear import cpu_name  # noqa: E402
from inferflux.kernels import cpu as cpu_kernels  # noqa: E402


def projections(model: torch.nn.Module) -> list[ql.QuantLinear]:
    out = [p for layer in model.layers for p in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down)]
    return [*out, model.head_linear.linear]


def step_seconds(projs: list[ql.QuantLinear], xs: dict[int, torch.Tensor], kernel: str) -> float:
    start = time.perf_counter()
    for p in projs:
        x = xs[p.in_features]
        if kernel == "exact":
            cpu_kernels.exact_linear(x, p.blocks, p.qtype)
        elif p.packed_dense is not None:
            ql.packed_linear(x, p.packed_dense)
        else:
            torch.nn.functional.linear(x, p.dense_weight)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,6,8,12,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if cpu_kernels.load() is None or not cpu_kernels.exact_linear_supported(dtype):
        need = "AVX-512 BF16" if dtype == torch.bfloat16 else "a C++ compiler"
        raise SystemExit(f"exact_linear is not built here for {args.dtype} (it needs the C++ kernels and {need})")
    backend = CPUBackend()
    backend.load(ModelSpec(name="smol", path=default_model_path(), dtype=args.dtype, passes={"quantise": "exact"}))
    projs = projections(backend.model)
    if dtype == torch.bfloat16 and any(p.packed_dense is None for p in projs):
        raise SystemExit("oneDNN's bfloat16 packing is not available here: nothing to compare against")
    peer = "packed bfloat16 GEMM (oneDNN)" if dtype == torch.bfloat16 else "float32 F.linear"
    for p in projs:  # the contract, before any timing
        x = torch.randn(5, p.in_features).to(dtype)
        for rows in (1, 5):
            want = cpu_kernels.loaded().invariant_linear(x[:rows], p.dense(dtype), None)
            if not torch.equal(cpu_kernels.exact_linear(x[:rows], p.blocks, p.qtype), want):
                raise SystemExit("exact_linear differs from invariant_linear on the dense weights")
    blocks_mb = sum(p.blocks.numel() for p in projs) / 1e6
    dense_mb = sum(p.out_features * p.in_features * dtype.itemsize for p in projs) / 1e6
    print(f"# exact_linear vs {peer}, {args.dtype} - {cpu_name()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"# method: every projection of SmolLM2-135M as one step ({len(projs)} calls: blocks {blocks_mb:.0f} MB, "
          f"dense {dense_mb:.0f} MB), the two kernels alternating step by step, {args.rounds} rounds x "
          f"{args.steps} steps, median ms a step; exact checked bit for bit against invariant_linear first")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).to(dtype) for k in {p.in_features for p in projs}}
        times: dict[str, list[float]] = {"exact": [], "packed": []}
        for kernel in times:  # warm-up
            step_seconds(projs, xs, kernel)
        for _ in range(args.rounds):
            for _ in range(args.steps):
                for kernel in times:
                    times[kernel].append(step_seconds(projs, xs, kernel))
        exact, packed = (statistics.median(times[k]) * 1e3 for k in ("exact", "packed"))
        results.append({"rows": rows, "exact_ms": exact, "packed_ms": packed, "speedup": packed / exact})
        print(f"rows {rows:3d}: exact_linear {exact:7.2f} ms   {peer} {packed:7.2f} ms   "
              f"exact is {packed / exact:4.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "threads": torch.get_num_threads(),
                                               "dtype": args.dtype, "peer": peer,
                                               "blocks_mb": blocks_mb, "dense_mb": dense_mb, "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
