#!/usr/bin/env python3
"""Quantised projections (backends/cpu/linear.py) against dense bfloat16, by batch rows.

Method
------
The shipped GGUF (default: the bundled SmolLM2-135M Q4_1) is loaded twice through
``CPUBackend``: ``passes: {quantise: native}`` (the file's blocks) and ``bf16`` (dense).
For layer 0's four projections (qkv, o_proj, gate_up, down) and the output head, at
each row count M in ``--rows``, three ways to compute ``x @ W.T`` are timed on the
same random bfloat16 input: ``qmatmul`` (the C++ kernel on the blocks), ``gemm``
(dequantise per tile into bfloat16, then torch's GEMM: QuantLinear's large-batch
path) and ``dense`` (``F.linear`` on the dense bfloat16 weight, what the model ran
before). Each is called ``--warmup`` times, then ``--reps`` times, timed one call
at a time with ``time.perf_counter``; the median (``--fastest``: the fastest call, the
better estimate on a machine others load) is reported, in microseconds for
the whole model's projections (layer 0's times ``num_layers``, plus the head).
The crossover is the smallest M at which ``gemm`` is faster than ``qmatmul`` for
the layer projections; ``GEMM_FROM_ROWS`` in backends/cpu/linear.py records it.

Figures on a loaded machine are provisional: the script prints the load average
and the CPU with them.

Usage:
    .venv/bin/python benchmarks/bench_qmatmul.py [--rows 1,2,4,8,16,32,64] [--reps 20] [--threads N] [--fastest] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable

import torch

FASTEST = False


def _median_us(fn: Callable[[], Any], warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    # The fastest call: on a shared, loaded machine the median measures the neighbours.
    return (min(times) if FASTEST else statistics.median(times)) * 1e6


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")),
                    platform.processor())
    except OSError:
        return platform.processor()


def main() -> int:
    from inferflux.backends.base import ModelSpec
    from inferflux.backends.cpu import CPUBackend
    from inferflux.backends.models import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2)")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--fastest", action="store_true", help="report each case's fastest call, not the median")
    args = ap.parse_args()
    global FASTEST
    FASTEST = args.fastest
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or default_model_path()

    def load(mode: str) -> Any:
        b = CPUBackend()
        b.load(ModelSpec(name="m", path=path, dtype="bfloat16", passes={"quantise": mode}))
        return b.model

    quant, dense = load("native"), load("bf16")
    layers = quant.cfg.num_layers
    pairs = [(getattr(quant.layers[0].attn, n), getattr(dense.layers[0].attn, n).weight) for n in ("qkv", "o_proj")]
    pairs += [(getattr(quant.layers[0].mlp, n), getattr(dense.layers[0].mlp, n).weight) for n in ("gate_up", "down")]
    head = quant.head_linear.linear
    head_w = dense.embed.weight if dense.lm_head is None else dense.lm_head.weight
    results = []
    print(f"# {_cpu()}, {torch.get_num_threads()} threads, load average {os.getloadavg()}")
    print(f"{'rows':>5} {'part':>6} {'qmatmul us':>12} {'gemm us':>12} {'dense bf16 us':>14}")
    for m in (int(r) for r in args.rows.split(",")):
        row: dict[str, Any] = {"rows": m}
        for part, items, times in (("layers", pairs, layers), ("head", [(head, head_w)], 1)):
            q = g = d = 0.0
            for mod, w in items:
                x = torch.randn(m, mod.in_features).to(torch.bfloat16)
                saved = mod.gemm_from
                mod.gemm_from = 1 << 30
                q += _median_us(lambda: mod(x), args.warmup, args.reps)
                mod.gemm_from = 0
                g += _median_us(lambda: mod(x), args.warmup, args.reps)
                mod.gemm_from = saved
                d += _median_us(lambda: torch.nn.functional.linear(x, w), args.warmup, args.reps)
            row[part] = {"qmatmul_us": round(q * times), "gemm_us": round(g * times), "dense_us": round(d * times)}
            print(f"{m:>5} {part:>6} {q * times:>12.0f} {g * times:>12.0f} {d * times:>14.0f}")
        results.append(row)
    crossover = next((r["rows"] for r in results if r["layers"]["gemm_us"] < r["layers"]["qmatmul_us"]), None)
    print(f"crossover (layers: gemm faster than qmatmul from): {crossover} rows")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": _cpu(), "threads": torch.get_num_threads(), "statistic": "min" if FASTEST else "median", "loadavg": os.getloadavg(),
                       "model": os.path.basename(path), "results": results, "crossover_rows": crossover}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
