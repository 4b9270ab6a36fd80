#!/usr/bin/env python3
"""Our dequantisers (``backends.models.quants``) against the ``gguf`` package's, in one process.

Why this exists: ``backends/models/quants.py`` keeps a dequantiser of its own for a ggml
type only where this benchmark shows it beating ``gguf.quants.dequantize``; every other type
goes to gguf's. Rerun it when gguf is upgraded, and drop a path of ours that no longer wins.

Method
------
For each ggml type we have a path of our own (``quants.OWN_PATHS``), a tensor of random
blocks (float16 scales kept finite) of ``--rows`` x ``--cols`` elements is decoded to
float32 by ours and by gguf's, alternating (ours, gguf's, ours, ...) ``--repeats`` times
after one warm-up each; the two results are checked equal. Then the whole bundled default
model (SmolLM2-135M, Q4_1 with F32 norms and a Q8_0 embedding) is decoded the same way,
tensor by tensor, by ``quants.dequantize`` and by gguf's alone.

Reported: the median CPU time of this process (``time.process_time``: numpy runs these on
one thread, and CPU time is what a busy shared machine disturbs least) and the median wall
time, per path, and the ratio gguf / ours of the CPU medians (above 1: ours is faster).
The CPU model comes from ``lscpu``.

Usage:
    .venv/bin/python benchmarks/bench_dequant.py [--rows 2048] [--cols 2048] [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np


import gguf  # noqa: E402
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from inferflux.backends.models import default_model_path, quants  # noqa: E402
from inferflux.backends.models.gguf_loader import GGUFModel  # noqa: E402

# Byte offsets of each block's float16 scales: random bytes there could be inf or NaN.
F16_SCALES = {
    GGMLQuantizationType.Q4_0: (0,), GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,), GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q8_0: (0,), GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2), GGMLQuantizationType.Q6_K: (208,),
}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """``rows`` x ``cols`` elements of ``qtype`` as raw bytes ``[rows, bytes per row]``."""
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block_elems * block_bytes), dtype=np.uint8)
    if qtype == GGMLQuantizationType.BF16:
        raw.reshape(-1, 2)[:, 1] &= 0x7E  # exponent never all ones: every value finite
    blocks = raw.reshape(-1, block_bytes)
    for offset in F16_SCALES.get(qtype, ()):
        blocks[:, offset : offset + 2] = rng.uniform(-3, 3, size=(blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw


def alternate(paths: dict[str, Callable[[], Any]], repeats: int) -> dict[str, dict[str, float]]:
    """Median CPU and wall seconds of each path, the paths run in turn ``repeats`` times."""
    for run in paths.values():
        run()  # warm-up: page in, allocate
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    wall: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, run in paths.items():
            c0, w0 = time.process_time(), time.perf_counter()
            run()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    return {name: {"cpu_s": statistics.median(cpu[name]), "wall_s": statistics.median(wall[name])} for name in paths}


def gguf_whole(tensors: list[Any]) -> None:
    for t in tensors:
        gguf.quants.dequantize(t.data, t.tensor_type)


def ours_whole(model: GGUFModel, tensors: list[Any]) -> None:
    for t in tensors:
        quants.dequantize(t.data, int(t.tensor_type), model._shape(t))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048, help="a multiple of 256 (a k-quant super-block)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="write the results here as well")
    args = ap.parse_args()

    results: dict[str, Any] = {
        "cpu": cpu_name(), "python": platform.python_version(), "numpy": np.__version__,
        "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        "rows": args.rows, "cols": args.cols, "repeats": args.repeats, "types": {},
    }
    print(f"CPU: {results['cpu']}; numpy {results['numpy']}, gguf {results['gguf']}, "
          f"median of {args.repeats} alternating runs (CPU seconds of this process; wall in brackets)")
    print(f"{'type':<8}{'ours ms':>18}{'gguf ms':>18}{'gguf/ours':>11}")
    for qtype in sorted(quants.OWN_PATHS, key=lambda t: t.name):
        raw = random_blocks(qtype, args.rows, args.cols, seed=int(qtype))
        shape = (args.rows, args.cols)
        ours = quants.dequantize(raw, qtype, shape)
        theirs = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(shape)
        np.testing.assert_array_equal(ours, theirs)
        timing = alternate({
            "ours": lambda: quants.dequantize(raw, qtype, shape),
            "gguf": lambda: gguf.quants.dequantize(raw, qtype),
        }, args.repeats)
        results["types"][qtype.name] = timing
        report(qtype.name, timing)

    model = GGUFModel(default_model_path())
    tensors = list(model._tensors.values())
    timing = alternate({"ours": lambda: ours_whole(model, tensors), "gguf": lambda: gguf_whole(tensors)},
                       args.repeats)
    results["default_model"] = timing
    report("model", timing)
    print("model = the whole default model, tensor by tensor, through quants.dequantize (ours where kept)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def report(name: str, timing: dict[str, dict[str, float]]) -> None:
    ours, theirs = timing["ours"], timing["gguf"]
    cell = lambda t: f"{t['cpu_s'] * 1e3:8.1f} ({t['wall_s'] * 1e3:6.1f})"  # noqa: E731
    print(f"{name:<8}{cell(ours):>18}{cell(theirs):>18}{theirs['cpu_s'] / ours['cpu_s']:>10.2f}x")


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
