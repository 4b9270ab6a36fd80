#!/usr/bin/env python3
"""Engine-only throughput: no HTTP, no gateway.

Builds the engine in-process, as the server does:

    backend = backends.registry.get_backend("cpu")(); info = backend.load(ModelSpec(...))
    tokenizer = backends.models.open_model(path).tokenizer()
    engine = backends.engine.LLMEngine(backend, tokenizer, info, EngineConfig(...))

submits N requests at once (the bench_serving.py workload: 128-token prompts, 128
generated tokens, greedy, ignore_eos), steps until every request is done and reports
generated tokens/s plus per-step timing (engine step and the backend's forward alone).

The synchronous stepping API is not in the contract; the script uses
``engine.add_request(request_id, prompt_token_ids, params)`` + ``engine.step()`` (returning
RequestOutputs) when the engine has them, and otherwise drives ``AsyncEngine.generate``
with N concurrent consumers (then "step" timings are the backend forward calls).

Usage:
    .venv/bin/python benchmarks/bench_offline.py --num-requests 32 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import (  # noqa: E402
    PromptTokenizer,
    _self_cpu,
    _system_cpu,
    build_prompts,
    machine_info,
    pct,
)


class _Tok(PromptTokenizer):
    def __init__(self, tok: Any):
        self.tok = tok
        self.method = "backends.models tokenizer"

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))


class TimedForward:
    """Wraps backend.forward to time each model step and classify it."""

    def __init__(self, backend: Any):
        self.inner = backend.forward
        self.records: list[tuple[float, int, int, int]] = []  # (seconds, num_tokens, num_seqs, num_logits)
        self.enabled = True

    def __call__(self, batch: Any) -> Any:
        t0 = time.perf_counter()
        out = self.inner(batch)
        if self.enabled:
            try:
                import numpy as np

                out = np.asarray(out)  # include any lazy work in the timing
            except Exception:  # noqa: BLE001
                pass
            self.records.append((time.perf_counter() - t0, batch.num_tokens, len(batch.slices), batch.num_logits))
        return out


def make_engine_config(EngineConfig: Any, n: int, overrides: dict[str, Any]) -> Any:
    kwargs: dict[str, Any] = {}
    names: set[str] = set()
    if dataclasses.is_dataclass(EngineConfig):
        names = {f.name for f in dataclasses.fields(EngineConfig)}
    else:
        with_params = inspect.signature(EngineConfig).parameters
        names = set(with_params)
    for k in ("max_num_seqs", "max_batch_size"):  # let all N requests run together
        if k in names:
            kwargs[k] = n
    kwargs.update(overrides)
    return EngineConfig(**kwargs)


def _len(x: Any) -> int:
    return len(x) if x is not None else 0


def run_sync(engine: Any, reqs: list[tuple[str, list[int]]], params: Any, deadline: float,
             max_steps: int) -> tuple[int, list[float], dict[str, float]]:
    step_times: list[float] = []
    first_token: dict[str, float] = {}
    generated = 0
    finished: set[str] = set()
    t0 = time.perf_counter()
    for rid, ids in reqs:
        engine.add_request(rid, ids, params)
    has_unfinished = getattr(engine, "has_unfinished_requests", None) or getattr(engine, "has_unfinished", None)
    steps = 0
    while True:
        if has_unfinished is not None:
            if not has_unfinished():
                break
        elif len(finished) == len(reqs):
            break
        if time.perf_counter() > deadline or steps >= max_steps:
            raise TimeoutError(f"gave up after {steps} steps / deadline; {len(finished)}/{len(reqs)} finished")
        s0 = time.perf_counter()
        outs = engine.step() or []
        now = time.perf_counter()
        step_times.append(now - s0)
        steps += 1
        for o in outs:
            k = _len(getattr(o, "new_token_ids", None))
            generated += k
            if k and o.request_id not in first_token:
                first_token[o.request_id] = now - t0
            if getattr(o, "finished", False):
                finished.add(o.request_id)
    return generated, step_times, first_token


async def run_async(AsyncEngine: Any, engine: Any, reqs: list[tuple[str, list[int]]], params: Any,
                    timeout: float) -> tuple[int, list[float], dict[str, float]]:
    aengine = AsyncEngine(engine)
    aengine.start()
    first_token: dict[str, float] = {}
    counts: dict[str, int] = {}
    t0 = time.perf_counter()

    async def one(rid: str, ids: list[int]) -> None:
        async for o in aengine.generate(rid, ids, params):
            k = _len(o.new_token_ids)
            counts[rid] = counts.get(rid, 0) + k
            if k and rid not in first_token:
                first_token[rid] = time.perf_counter() - t0

    try:
        await asyncio.wait_for(asyncio.gather(*(one(r, i) for r, i in reqs)), timeout)
    finally:
        res = aengine.shutdown()
        if inspect.isawaitable(res):
            await res
    return sum(counts.values()), [], first_token


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--model", help="GGUF file or safetensors dir (default: backends.models.default_model_path())")
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=0, help="backend threads (0: backend default)")
    p.add_argument("--num-requests", "-n", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--engine-config", default="{}", help="JSON of extra EngineConfig fields")
    p.add_argument("--api", choices=["auto", "sync", "async"], default="auto",
                   help="drive LLMEngine.step() (sync) or AsyncEngine.generate (async)")
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline for the measured run (s)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    from backends.base import ModelSpec
    from backends.engine import EngineConfig, LLMEngine, SamplingParams
    from backends.models import default_model_path, open_model
    from backends.registry import get_backend

    path = args.model or default_model_path()
    t_load = time.perf_counter()
    cls = get_backend(args.backend)
    backend = cls(num_threads=args.threads) if args.threads else cls()
    info = backend.load(ModelSpec(name=Path(path).stem, path=path, dtype=args.dtype))
    tokenizer = open_model(path).tokenizer()
    timed = TimedForward(backend)
    backend.forward = timed  # instance attribute shadows the method
    cfg = make_engine_config(EngineConfig, args.num_requests, json.loads(args.engine_config))
    engine = LLMEngine(backend, tokenizer, info, cfg)
    load_s = time.perf_counter() - t_load

    prompts, counts = build_prompts(args.num_requests + 1, args.prompt_tokens, _Tok(tokenizer))
    ids = [tokenizer.encode(t, add_special_tokens=False)[: args.prompt_tokens] for t in prompts]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    if hasattr(params, "validate"):
        params.validate(info.vocab_size)

    use_sync = args.api == "sync" or (
        args.api == "auto" and hasattr(engine, "add_request") and hasattr(engine, "step"))
    if not use_sync:
        from backends.engine import AsyncEngine

    max_steps = args.num_requests * (args.prompt_tokens + args.output_tokens) + 1000

    def run(reqs: list[tuple[str, list[int]]], prm: Any, timeout: float) -> tuple[int, list[float], dict[str, float]]:
        if use_sync:
            return run_sync(engine, reqs, prm, time.perf_counter() + timeout, max_steps)
        return asyncio.run(run_async(AsyncEngine, engine, reqs, prm, timeout))

    if not args.no_warmup:  # one short request: first-call costs (allocation, kernels) out of the timing
        timed.enabled = False
        warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        run([("warmup", ids[-1])], warm, 300.0)
        timed.enabled = True
        if not use_sync:  # AsyncEngine was shut down; rebuild the engine on the same backend
            engine = LLMEngine(backend, tokenizer, info, cfg)

    reqs = [(f"r{i}", ids[i]) for i in range(args.num_requests)]
    sys0, me0 = _system_cpu(), _self_cpu()
    t0 = time.perf_counter()
    generated, step_times, first_token = run(reqs, params, args.timeout)
    wall = time.perf_counter() - t0
    sys1, me1 = _system_cpu(), _self_cpu()
    cpu_self = (me1 - me0) / wall if wall else None
    cpu_other = max(0.0, (sys1[0] - sys0[0]) / wall - cpu_self) if wall and sys1[1] else None

    fwd = timed.records
    prefill = [r for r in fwd if r[1] > r[2]]  # more tokens than sequences: contains a prefill chunk
    decode = [r for r in fwd if r[1] == r[2]]
    ms = lambda xs: [x * 1e3 for x in xs]  # noqa: E731
    result = {
        "machine": machine_info(),
        "model": path, "dtype": info.dtype, "backend": args.backend,
        "engine_config": repr(cfg), "api": "LLMEngine.step" if use_sync else "AsyncEngine.generate",
        "num_requests": args.num_requests, "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "load_s": round(load_s, 2),
        "wall_s": round(wall, 3), "generated_tokens": generated,
        "generated_tok_s": round(generated / wall, 2) if wall else None,
        "total_tok_s": round((generated + args.num_requests * args.prompt_tokens) / wall, 2) if wall else None,
        "steps": len(step_times) or len(fwd),
        "step_ms": {q: pct(ms(step_times), q) for q in (50, 90, 99)} if step_times else None,
        "forward_calls": len(fwd),
        "forward_ms_total": round(sum(r[0] for r in fwd) * 1e3, 1),
        "forward_share_of_wall": round(sum(r[0] for r in fwd) / wall, 3) if wall else None,
        "prefill_forward": {"calls": len(prefill), "tokens": sum(r[1] for r in prefill),
                            "ms_p50": pct(ms([r[0] for r in prefill]), 50),
                            "ms_total": round(sum(r[0] for r in prefill) * 1e3, 1)},
        "decode_forward": {"calls": len(decode),
                           "mean_batch": statistics.fmean([r[2] for r in decode]) if decode else None,
                           "ms_p50": pct(ms([r[0] for r in decode]), 50),
                           "ms_p90": pct(ms([r[0] for r in decode]), 90),
                           "ms_total": round(sum(r[0] for r in decode) * 1e3, 1)},
        "ttft_s": {q: pct(list(first_token.values()), q) for q in (50, 90)},
        "cpu_cores_self": round(cpu_self, 2) if cpu_self is not None else None,
        "cpu_cores_other": round(cpu_other, 2) if cpu_other is not None else None,
    }
    m = result["machine"]
    print(f"engine-only, {m['cpu']} (nproc {m['nproc']}), {Path(path).name}, dtype {info.dtype}, "
          f"{result['api']}")
    print(f"{args.num_requests} requests x ({args.prompt_tokens} prompt + {args.output_tokens} generated): "
          f"{generated} tokens in {wall:.2f}s = {result['generated_tok_s']} generated tok/s "
          f"({result['total_tok_s']} incl. prompt)")
    if step_times:
        s = result["step_ms"]
        print(f"engine steps: {len(step_times)}, step ms p50 {s[50]:.1f} p90 {s[90]:.1f} p99 {s[99]:.1f}")
    d, pf = result["decode_forward"], result["prefill_forward"]
    print(f"backend forward: {len(fwd)} calls, {result['forward_share_of_wall'] * 100:.0f}% of wall; "
          f"prefill {pf['calls']} calls / {pf['tokens']} tokens / {pf['ms_total']:.0f} ms; "
          f"decode {d['calls']} calls, mean batch {d['mean_batch'] or 0:.1f}, "
          f"ms p50 {d['ms_p50'] or 0:.1f} p90 {d['ms_p90'] or 0:.1f}")
    other = result["cpu_cores_other"]
    print(f"CPU during the run: this process {result['cpu_cores_self']} cores, other processes {other} cores"
          + ("  DISTURBED: other work took CPU, rerun on a quiet machine" if other is not None and other > 0.3
             else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
