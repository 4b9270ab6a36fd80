#!/usr/bin/env python3
"""Where a single-stream decode step's time goes: inside kernels, or outside them
(Python, op dispatch, building the step's inputs).

One sequence (a ``--prompt-tokens`` prompt, prefilled first) is decoded through
``CPUBackend.forward`` for ``--steps`` steps; the step's inputs are built by the backend
as in serving. Two measurements in the same process:

1. wall time per step without the profiler (the figure that matters), split into
   input preparation (``CPUBackend._prepare``) and the model's forward;
2. one profiled pass (``torch.profiler``, CPU): time inside any op (the sum of every
   op's self time: ATen ops, and the C++ extension's calls) is *kernel* time; the rest of
   the step (Python between ops, building the step's inputs) is *outside*. The profiler adds
   its own cost per op, so the outside share it gives is an upper bound; the op count per
   step is exact.

``--kernels`` picks the kernel sets, measured one after the other in one run: ``loop`` (the
C++ loop over layers, backends/cpu/decode_loop.py: needs a quantised ``--quantise`` mode),
``fast`` (the default set, kernels/cpu/fast.py: fused elementwise C++ kernels and paged
attention, the layers run from Python),
``unfused`` (the reference's elementwise ops with the compiled paged attention: the set
before the fused kernels) and ``reference`` (PyTorch only). The C++ extension's functions
are wrapped in ``torch.profiler.record_function`` so their time counts as kernel time
(the profiler does not see inside a pybind11 call otherwise).

Usage:
    .venv/bin/python benchmarks/bench_step_overhead.py --dtype bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any



def _profile_extension() -> None:
    """Make every function of the compiled extension show in the profiler as one leaf op."""
    import torch

    from inferflux.kernels import cpu

    module = cpu.load()
    if module is None or getattr(module, "_profiled", False):
        return

    def wrap(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(f"cpp::{name}"):
                return fn(*args, **kwargs)
        return call

    for name in dir(module):
        fn = getattr(module, name)
        if not name.startswith("_") and callable(fn) and type(fn).__name__ == "builtin_function_or_method":
            setattr(module, name, wrap(name, fn))
    module._profiled = True


def _profile_loop(loop: Any) -> None:
    """The decode loop's one call a step as one leaf op (its kernels run inside it)."""
    import torch

    run = loop.run

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function("cpp::DecodeLoop.step"):
            return run(*args, **kwargs)
    loop.run = call


def measure(path: str, dtype: str, prompt_tokens: int, steps: int, which: str, threads: int,
            quantise: str = "auto") -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from inferflux.backends.base import Batch, ModelSpec, SequenceSlice
    from inferflux.backends.cpu.backend import CPUBackend

    _profile_extension()
    backend = CPUBackend(num_threads=threads or None)
    info = backend.load(ModelSpec(name="step", path=path, dtype=dtype, passes={"quantise": quantise}))
    if which == "loop":
        if backend.model.decode_loop is None:
            raise SystemExit(f"--kernels loop: no decode loop with quantise {quantise} (see the decode_loop pass)")
        _profile_loop(backend.model.decode_loop)
    elif which == "fast":
        backend.model.decode_loop = None  # the layers from Python
    elif backend.model is not None:
        from inferflux.kernels import cpu, reference

        backend.model.use_kernels(reference)
        if which == "unfused" and backend.kernel_error is None:
            backend.model.use_paged_attention(cpu.paged_attention)
    bs = 16
    total = prompt_tokens + steps * 3 + 8
    blocks = list(range(-(-total // bs)))
    backend.allocate_kv(len(blocks), bs)
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(prompt_tokens)]
    pos = prompt_tokens
    backend.forward(Batch([SequenceSlice(0, prompt, 0, blocks)], bs))

    def step() -> None:
        nonlocal pos
        backend.forward(Batch([SequenceSlice(0, [pos % 1000 + 10], pos, blocks)], bs))
        pos += 1

    for _ in range(5):  # warm: first-call costs out of the timing
        step()
    prepare = backend._prepare
    prep_times: list[float] = []

    def timed_prepare(batch: Batch) -> Any:
        t0 = time.perf_counter()
        out = prepare(batch)
        prep_times.append(time.perf_counter() - t0)
        return out

    backend._prepare = timed_prepare  # type: ignore[method-assign]
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
    backend._prepare = prepare  # type: ignore[method-assign]

    profiled = max(3, steps // 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(profiled):
            step()
        prof_wall = (time.perf_counter() - t0) / profiled
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    # Self times exclude children, so their sum is the time spent inside some op, counted once.
    kernel_s = sum(e.self_cpu_time_total for e in events) / 1e6 / profiled
    ops = sum(1 for e in events if e.cpu_parent is None)  # ops called from Python (each a dispatch)
    step_ms = statistics.median(walls) * 1e3
    prep_ms = statistics.median(prep_times) * 1e3
    return {
        "kernels": which if backend.kernel_error is None else f"{which} (C++ unavailable: reference)",
        "quantise": quantise, "loadavg_at_end": Path("/proc/loadavg").read_text().split()[0],
        "passes": [f"{r.get('name')}: {r.get('detail')}" for r in info.passes],
        "dtype": info.dtype, "threads": torch.get_num_threads(), "steps": steps,
        "context": f"{prompt_tokens}..{prompt_tokens + steps + 5}",
        "step_ms_p50": round(step_ms, 3), "tok_s": round(1e3 / step_ms, 1),
        "prepare_ms_p50": round(prep_ms, 3),
        "profiled_step_ms": round(prof_wall * 1e3, 3),
        "kernel_ms_per_step": round(kernel_s * 1e3, 3),
        "outside_share_profiled": round(1 - kernel_s / prof_wall, 3),
        "ops_per_step": round(ops / profiled),
        "top_ops": [(e.key, round(e.self_cpu_time_total / 1e3 / profiled, 3), e.count // profiled)
                    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="GGUF or safetensors dir (default: backends.models.default_model_path())")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kernels", default="unfused,fast", help="which kernel sets, in order: loop, fast, unfused, "
                   "reference (each once; repeat names to alternate)")
    p.add_argument("--quantise", default="auto", help="passes.quantise of the load (native, hybrid, ...; auto: dense)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: its default). 1 keeps OpenMP waits out of the kernels' time on a "
                        "machine that other work loads")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    from inferflux.backends.models import default_model_path

    path = args.model or default_model_path()
    results = []
    for which in [k.strip() for k in args.kernels.split(",") if k.strip()]:
        r = measure(path, args.dtype, args.prompt_tokens, args.steps, which, args.threads, args.quantise)
        results.append(r)
        print(f"[step] {r['kernels']:<9} {r['dtype']}: step p50 {r['step_ms_p50']:.2f} ms ({r['tok_s']} tok/s), "
              f"inputs {r['prepare_ms_p50']:.3f} ms; profiled {r['profiled_step_ms']:.2f} ms of which kernels "
              f"{r['kernel_ms_per_step']:.2f} ms: outside {r['outside_share_profiled']:.0%}, "
              f"{r['ops_per_step']} ops a step", file=sys.stderr)
        for name, ms, count in r["top_ops"]:
            print(f"         {name:<40} {ms:8.3f} ms  x{count}", file=sys.stderr)
    if args.json:
        meta = {"model": path, "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
