#!/usr/bin/env python3
"""The Triton kernels (kernels/triton) against their PyTorch reference, on one GPU.

Method
------
Every kernel and its ``kernels.reference`` counterpart run on the same GPU, on the
same inputs, shaped like one layer of the chosen model (``--model``) at a decode
batch (``--batch`` tokens) and, for the elementwise kernels, a prefill chunk
(``--prefill-tokens``). Each pair is first checked for agreement (max abs error,
allclose at the dtype's tolerance), then timed: ``--warmup`` untimed calls, then
``--reps`` calls each bracketed by two CUDA events (``torch.cuda.Event``), one
``torch.cuda.synchronize()`` before the events are read. Reported per kernel: the
median (and min, p90) in microseconds, the reference/Triton ratio of the medians,
and the effective bandwidth (bytes the kernel must read and write / median time).
Inputs are not flushed from L2 between calls; the decode attention working set
(the KV cache read) is far larger than L2 at the default shapes.

Paged attention uses a KV cache of scattered blocks: each sequence's blocks are a
random sample of the cache, as after a while of serving. Each attention case runs
twice: as served (inside a CUDA graph, the 'device' column, the context is split
into shares where the grid would leave the GPU idle: kernels/triton/paged_attention.py;
eager calls never split) and with one share (``splits=1``).

Model decode step: the bundled SmolLM2 on the CUDA backend (``backends.cuda``,
Triton kernels), with CUDA graphs and without, at decode batches of 1, 8 and 32
sequences each ``--context`` tokens in: ``--warmup`` untimed steps, then
``--reps`` timed ``forward`` calls by wall clock (each returns the logits on the
host, so each call ends synchronised); median milliseconds and tokens/s. The
step's peer is the same step without graphs (the reference kernel set was not
tried as a whole step on the GPU).

Kernel device time: the per-call events above also bracket the host's launch of
each call when the GPU is idle, so small kernels read the launch cost. Each case
is therefore also timed as ``--reps`` calls captured in one CUDA graph, replayed
5 times between two events (median replay / calls): the kernels' own time, as in
serving, where decode steps replay as graphs.

Without a CUDA/ROCm device the script exits with code 2, unless ``--interpret``:
then it runs tiny shapes under Triton's interpreter on the CPU as a correctness
smoke test (exit code 1 on a mismatch); those timings measure the interpreter, not
the kernels.

Usage:
    .venv/bin/python benchmarks/bench_kernels.py [--model llama3-8b] [--dtype bfloat16] [--batch 32]
        [--context 1024] [--warmup 10] [--reps 100] [--json out.json]
    .venv/bin/python benchmarks/bench_kernels.py --interpret
    .venv/bin/python benchmarks/bench_kernels.py --kernels-only   # no model decode step
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


NO_GPU_EXIT = 2

# One decoder layer's shapes: hidden, heads, kv_heads, head_dim, intermediate.
MODELS = {
    "llama3-8b": (4096, 32, 8, 128, 14336),
    "qwen2.5-7b": (3584, 28, 4, 128, 18944),
    "smollm2-135m": (576, 9, 3, 64, 1536),
}
TINY = (64, 6, 2, 32, 96)  # --interpret: the interpreter runs numpy per program


@dataclass
class Case:
    kernel: str
    shape: str
    triton: Callable[[], Any]
    reference: Callable[[], Any]
    bytes: int  # what the kernel must read and write at least


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--batch", type=int, default=32, help="sequences in a decode step")
    p.add_argument("--context", type=int, default=1024, help="context tokens per sequence")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--kernels-only", action="store_true",
                   help="skip the model decode step (it loads the bundled SmolLM2 on the CUDA backend)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    p.add_argument("--interpret", action="store_true",
                   help="no GPU needed: tiny shapes under TRITON_INTERPRET=1, a correctness smoke test")
    return p.parse_args(argv)


def build_cases(args: argparse.Namespace, torch: Any, KT: Any, R: Any, device: str) -> list[Case]:
    dtype = getattr(torch, args.dtype)
    hidden, heads, kv_heads, head_dim, inter = TINY if args.interpret else MODELS[args.model]
    batch, context, bs = args.batch, args.context, args.block_size
    prefill = args.prefill_tokens
    size = torch.finfo(dtype).bits // 8
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> Any:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    cases: list[Case] = []
    eps = 1e-6
    for tokens in (batch, prefill):
        x, res, w = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
        cases.append(Case("rms_norm", f"[{tokens}, {hidden}]", lambda x=x, w=w: KT.rms_norm(x, w, eps),
                          lambda x=x, w=w: R.rms_norm(x, w, eps), 2 * x.numel() * size))
        cases.append(Case("add_rms_norm", f"[{tokens}, {hidden}]",
                          lambda x=x, r=res, w=w: KT.add_rms_norm(x, r, w, eps),
                          lambda x=x, r=res, w=w: R.add_rms_norm(x, r, w, eps), 4 * x.numel() * size))
        # q and k rotated together as a view into the fused qkv projection, as the model does.
        qkv = randn(tokens, heads + 2 * kv_heads, head_dim)
        qk = qkv[:, : heads + kv_heads]
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        positions = torch.randint(0, context, (tokens,), generator=torch.Generator().manual_seed(1))
        cos, sin = (t.to(device) for t in R.rope_cos_sin(positions, inv_freq, dtype))
        cases.append(Case("apply_rope", f"[{tokens}, {heads}+{kv_heads}, {head_dim}] view",
                          lambda qk=qk, c=cos, s=sin: KT.apply_rope(qk, c, s),
                          lambda qk=qk, c=cos, s=sin: R.apply_rope(qk, c, s),
                          (2 * qk.numel() + 2 * cos.numel()) * size))
        gate_up = randn(tokens, 2 * inter)
        cases.append(Case("silu_and_mul", f"[{tokens}, {2 * inter}]", lambda a=gate_up: KT.silu_and_mul(a),
                          lambda a=gate_up: R.silu_and_mul(a), gate_up.numel() * size * 3 // 2))
        # store_kv: both write into a cache of their own; repeating a store is idempotent.
        num_blocks = (tokens + bs - 1) // bs * 2
        caches = [torch.zeros(kv_heads, num_blocks, bs, head_dim, device=device, dtype=dtype) for _ in range(4)]
        k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        slots = torch.randperm(num_blocks * bs, generator=torch.Generator().manual_seed(2))[:tokens].to(device)

        def store(fn: Callable, kc: Any, vc: Any, k: Any = k, v: Any = v, slots: Any = slots) -> Callable[[], Any]:
            def run() -> Any:
                fn(kc, vc, k, v, slots)
                return kc, vc
            return run

        cases.append(Case("store_kv", f"{tokens} tokens x [{kv_heads}, {head_dim}]",
                          store(KT.store_kv, caches[0], caches[1]), store(R.store_kv, caches[2], caches[3]),
                          4 * k.numel() * size))

    # Paged attention: a decode step, a verification of 5-token drafts, a prefill chunk.
    attention = [
        ("decode", batch, 1, context),
        ("decode", 1, 1, context),
        ("verify k=4", max(1, batch // 4), 5, context),
        ("prefill chunk", 1, 256 if not args.interpret else 16, context),
    ]
    pg = torch.Generator().manual_seed(3)
    for label, seqs, q_len, ctx in attention:
        blocks_per_seq = (ctx + bs - 1) // bs
        num_blocks = seqs * blocks_per_seq + 8
        k_cache = randn(kv_heads, num_blocks, bs, head_dim)
        v_cache = randn(kv_heads, num_blocks, bs, head_dim)
        tables = torch.randperm(num_blocks, generator=pg)[: seqs * blocks_per_seq].view(seqs, blocks_per_seq)
        lens = torch.full((seqs,), ctx) - torch.randint(0, bs, (seqs,), generator=pg)  # end mid-block
        starts = lens - q_len
        tables, lens, starts = tables.to(device), lens.to(device), starts.to(device)
        q = randn(seqs, q_len, heads, head_dim)
        scale = head_dim**-0.5
        read = 2 * kv_heads * int(lens.sum()) * head_dim * size + 2 * q.numel() * size
        cases.append(Case(
            "paged_attention", f"{label}: {seqs} seqs x {q_len} q, ctx {ctx}, {heads}/{kv_heads} heads, d {head_dim}",
            lambda a=(q, k_cache, v_cache, tables, lens, starts, scale): KT.paged_attention(*a),
            lambda a=(q, k_cache, v_cache, tables, lens, starts, scale): R.paged_attention(*a),
            read,
        ))
        # The same without the split context (one program per sequence, KV head and row tile).
        cases.append(Case(
            "paged_attn 1 share", f"{label}: {seqs} seqs x {q_len} q, ctx {ctx}, {heads}/{kv_heads} heads, d {head_dim}",
            lambda a=(q, k_cache, v_cache, tables, lens, starts, scale): one_share(*a),
            lambda a=(q, k_cache, v_cache, tables, lens, starts, scale): R.paged_attention(*a),
            read,
        ))
    return cases


def one_share(*args: Any) -> Any:
    from inferflux.kernels.triton.paged_attention import _paged_attention

    return _paged_attention(*args, splits=1)


def flat(out: Any) -> list[Any]:
    return list(out) if isinstance(out, tuple) else [out]


def agreement(case: Case, torch: Any, dtype: Any) -> tuple[float, bool]:
    got, want = flat(case.triton()), flat(case.reference())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
    ok = all(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol) for a, b in zip(got, want))
    return err, ok


def time_cuda(fn: Callable[[], Any], torch: Any, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends)]  # ms -> us


def time_graph(fn: Callable[[], Any], torch: Any, reps: int, replays: int = 5) -> float | None:
    """Device time of one call, launch cost removed: ``reps`` calls captured in one CUDA
    graph, the graph replayed between two events ``replays`` times; the median replay
    divided by ``reps``. None where the call cannot be captured."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # allocations made once, outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except Exception:  # noqa: BLE001 - a call that cannot be captured is reported, not fatal
        return None
    graph.replay()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        per_call.append(start.elapsed_time(end) * 1000.0 / reps)
    return statistics.median(per_call)


def time_host(fn: Callable[[], Any], warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def device_columns(row: dict[str, Any]) -> str:
    if "triton_device_us" not in row:
        return ""
    t, r = row["triton_device_us"], row["reference_device_us"]
    shown = [f"{v:8.1f} us" if v is not None else "  no graph" for v in (t, r)]
    ratio = f"x{row['device_speedup']:5.2f}" if row["device_speedup"] else "     -"
    gb_s = f"{row['triton_device_gb_s']:7.1f} GB/s" if row["triton_device_gb_s"] else ""
    return f"  | device: triton {shown[0]}  ref {shown[1]}  {ratio}  {gb_s}"


DECODE_BATCHES = (1, 8, 32)


def model_decode_step(args: argparse.Namespace, torch: Any) -> list[dict[str, Any]]:
    """The default model's decode step on the CUDA backend, with and without CUDA graphs.

    Under ``--interpret`` the same code runs on the CPU with the reference kernels,
    to prove the path works; those numbers are not GPU measurements.
    """
    from inferflux.backends.base import Batch, ModelSpec, SequenceSlice
    from inferflux.backends.cuda import CUDABackend
    from inferflux.backends.models import default_model_path
    from inferflux.kernels import reference

    if args.interpret:
        variants = {"cpu, reference kernels (smoke)": dict(device="cpu", kernels=reference, cuda_graphs=False)}
    else:
        variants = {"cuda graphs": dict(cuda_graphs=True), "eager": dict(cuda_graphs=False)}
    bs, context = args.block_size, args.context
    per_seq = -(-(context + 1) // bs)
    rows = []
    for name, kwargs in variants.items():
        backend = CUDABackend(**kwargs)
        backend.load(ModelSpec(name="smollm2", path=default_model_path(), dtype=args.dtype))
        backend.allocate_kv(max(DECODE_BATCHES) * per_seq, bs)
        for n in DECODE_BATCHES:
            # What the cache holds does not change the work: each sequence decodes at
            # position ``context`` over its own run of blocks.
            batch = Batch([SequenceSlice(i, [1], context, list(range(i * per_seq, (i + 1) * per_seq)))
                           for i in range(n)], bs)  # fmt: skip
            step = summary(time_host(lambda: backend.forward(batch), args.warmup, args.reps))
            row = {"variant": name, "batch": n, "context": context, "median_ms": step["median_us"] / 1e3,
                   "tokens_per_s": n / (step["median_us"] / 1e6),
                   "graphs_in_use": getattr(backend, "decode_graphs", None) is not None}
            rows.append(row)
            fell_back = kwargs["cuda_graphs"] and not row["graphs_in_use"]
            print(f"decode step  {name:32s} batch {n:3d}  context {context:5d}  {row['median_ms']:8.2f} ms  "
                  f"{row['tokens_per_s']:9.1f} tok/s{'  (graph capture failed: eager)' if fell_back else ''}")
        del backend
    return rows


def summary(us: list[float]) -> dict[str, float]:
    ordered = sorted(us)
    return {"median_us": statistics.median(ordered), "min_us": ordered[0],
            "p90_us": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


def machine(torch: Any, triton: Any, device: str) -> dict[str, Any]:
    info = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "host": platform.node()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_mem_gib=round(props.total_memory / 2**30, 1),
                    runtime=f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}")
    else:
        info.update(gpu=None, runtime="Triton interpreter (TRITON_INTERPRET=1) on the CPU")
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret:
        # Must precede the first import of kernels.triton: Triton picks compiled or
        # interpreted kernels when they are defined.
        os.environ["TRITON_INTERPRET"] = "1"
        args.batch, args.context, args.prefill_tokens, args.block_size = 3, 40, 12, 8
        args.warmup, args.reps = 1, 3
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: nothing to benchmark", file=sys.stderr)
        return NO_GPU_EXIT
    if not args.interpret and not torch.cuda.is_available():
        print(f"no CUDA or ROCm device is visible to torch {torch.__version__}: this benchmark needs a GPU "
              "(run with --interpret for a CPU correctness smoke test under Triton's interpreter)", file=sys.stderr)
        return NO_GPU_EXIT
    try:
        import triton
    except ImportError:
        print("Triton is not installed (pip install 'inferflux[cuda]')", file=sys.stderr)
        return NO_GPU_EXIT

    import inferflux.kernels.triton as KT
    from inferflux.kernels import reference as R

    device = "cpu" if args.interpret else "cuda"
    dtype = getattr(torch, args.dtype)
    method = (
        f"{args.warmup} warm-up calls, then {args.reps} timed calls of each kernel; "
        + ("wall clock (time.perf_counter) per call under the Triton interpreter: NOT a speed measurement"
           if args.interpret else
           "each call between two CUDA events, torch.cuda.synchronize() before reading them")
        + "; median, min and p90 in microseconds; speedup = reference median / Triton median"
        + ("" if args.interpret else
           "; 'device' = the same calls captured in one CUDA graph, replayed 5 times between two events, "
           "median replay / calls: the kernels' own time, without the host's launch cost that the "
           "per-call events also bracket when the GPU is idle (serving replays decode steps as graphs)")
    )
    info = machine(torch, triton, device)
    where = f"{info['gpu']}, {info['runtime']}" if info["gpu"] else info["runtime"]
    print(f"# kernels.triton vs kernels.reference - {where}, torch {info['torch']}, triton {info['triton']}")
    model = "tiny (interpreter smoke)" if args.interpret else args.model
    print(f"# model {model}, dtype {args.dtype}, batch {args.batch}, context {args.context}, "
          f"prefill {args.prefill_tokens}, block size {args.block_size}")
    print(f"# method: {method}")

    results = []
    failed = []
    with torch.inference_mode():
        for case in build_cases(args, torch, KT, R, device):
            err, ok = agreement(case, torch, dtype)
            if not ok:
                failed.append(f"{case.kernel} {case.shape}")
            if args.interpret:
                t_us = time_host(case.triton, args.warmup, args.reps)
                r_us = time_host(case.reference, args.warmup, args.reps)
            else:
                t_us = time_cuda(case.triton, torch, args.warmup, args.reps)
                r_us = time_cuda(case.reference, torch, args.warmup, args.reps)
            t, r = summary(t_us), summary(r_us)
            row = {"kernel": case.kernel, "shape": case.shape, "max_abs_err": err, "agrees": ok,
                   "triton": t, "reference": r, "speedup": r["median_us"] / t["median_us"],
                   "triton_gb_s": case.bytes / (t["median_us"] * 1e3)}
            if not args.interpret:
                t_dev, r_dev = time_graph(case.triton, torch, args.reps), time_graph(case.reference, torch, args.reps)
                row.update(triton_device_us=t_dev, reference_device_us=r_dev,
                           device_speedup=r_dev / t_dev if t_dev and r_dev else None,
                           triton_device_gb_s=case.bytes / (t_dev * 1e3) if t_dev else None)
            results.append(row)
            print(f"{case.kernel:18s} {case.shape:60s} triton {t['median_us']:10.1f} us  "
                  f"ref {r['median_us']:10.1f} us  x{row['speedup']:5.2f}  {row['triton_gb_s']:7.1f} GB/s  "
                  f"err {err:.2e}{'' if ok else '  MISMATCH'}" + device_columns(row))
    decode = [] if args.kernels_only else model_decode_step(args, torch)

    report = {"machine": info, "method": method, "model": model, "dtype": args.dtype, "batch": args.batch,
              "context": args.context, "prefill_tokens": args.prefill_tokens, "block_size": args.block_size,
              "interpreter": args.interpret, "results": results, "model_decode_step": decode, "mismatches": failed}
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    if failed:
        print(f"MISMATCH against the reference: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
