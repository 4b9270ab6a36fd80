#!/usr/bin/env python3
"""Dense projections with weights packed once for oneDNN, against ``F.linear`` packing them on every call.

Why: at 32 rows a SmolLM2 decode step is almost all GEMM (``aten::mm`` 88 % of the
step's op time in a torch.profiler run on the 2-core AMD EPYC, 2026-11-26). ``F.linear``
on bfloat16 goes to oneDNN, which reorders the weight into its blocked layout on every
call; ``torch.ops.mkldnn._reorder_linear_weight`` does that once (what inductor's
weight freezing does), and ``torch.ops.mkldnn._linear_pointwise`` multiplies with the
packed copy. Nothing in the backend uses this yet: this measures whether it should.

Method: one "step" is the projections of a SmolLM2-135M-shaped model (``--layers`` layers
of qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536], then the
[49152, 576] head), each with its own random weights (270 MB in bfloat16, far more
than the caches, as in serving), at ``--rows`` rows. The two ways alternate, ``--rounds``
rounds of ``--steps`` steps each; medians. Before timing, the packed result is checked
bit-for-bit against ``F.linear`` at 1, 2, 5, 16, 31, 32, 33, 64 and 200 rows.

Usage:
    .venv/bin/python benchmarks/bench_packed_linear.py [--rows 32] [--rounds 5] [--steps 5] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o_proj, gate_up, down: [out, in]
HEAD = (49152, 576)
CHECK_ROWS = (1, 2, 5, 16, 31, 32, 33, 64, 200)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def bit_equal(dtype: torch.dtype) -> dict[int, bool]:
    torch.manual_seed(1)
    w = torch.randn(3072, 576).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
    out = {}
    for rows in CHECK_ROWS:
        x = torch.randn(rows, 576).to(dtype)
        out[rows] = torch.equal(torch.nn.functional.linear(x, w), packed_linear(x, packed))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    equal = bit_equal(dtype)

    torch.manual_seed(0)
    weights = [torch.randn(*shape).to(dtype) for _ in range(args.layers) for shape in SHAPES] + [torch.randn(*HEAD).to(dtype)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, args.rows) for w in weights]
    inputs = {k: torch.randn(args.rows, k).to(dtype) for k in {w.shape[1] for w in weights}}

    def plain_step() -> None:
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    def packed_step() -> None:
        for w, q in zip(weights, packed):
            packed_linear(inputs[w.shape[1]], q)

    ways = {"F.linear": plain_step, "packed once": packed_step}
    for step in ways.values():
        step()  # first-call costs out of the timing
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            start = time.perf_counter()
            for _ in range(args.steps):
                ways[name]()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    flops = 2 * args.rows * sum(w.shape[0] * w.shape[1] for w in weights)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{args.rows} rows, {args.layers} layers + head ({sum(w.numel() * w.element_size() for w in weights) / 1e6:.0f} MB)")
    print("packed == F.linear, bit for bit, at rows " + ", ".join(f"{k}: {v}" for k, v in equal.items()))
    print("| way | ms per step, median (range) | GFLOP/s |")
    print("|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {medians[name]:.2f} ({min(t):.2f}-{max(t):.2f}) | {flops / medians[name] / 1e6:.0f} |")
    print(f"packed once / F.linear: {medians['F.linear'] / medians['packed once']:.2f}x faster")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(), "args": vars(args),
            "bit_equal": equal, "ms_per_step": times, "medians_ms": medians,
        }, indent=1))


if __name__ == "__main__":
    main()
