#!/usr/bin/env python3
"""Engine-only throughput: no HTTP, no gateway.

Builds the engine in-process, as the server does:

    backend = backends.registry.get_backend("cpu")(); info = backend.load(ModelSpec(...))
    tokenizer = backends.models.open_model(path).tokenizer()
    engine = backends.engine.LLMEngine(backend, tokenizer, info, EngineConfig(...))

submits N requests at once (the bench_serving.py workload: 128-token prompts, 128
generated tokens, greedy, ignore_eos), steps until every request is done and reports
generated tokens/s plus per-step timing (engine step and the backend's forward alone).

It drives ``LLMEngine.add_request`` + ``LLMEngine.step()`` directly on this thread, so the
numbers are the engine's and the backend's alone (``bench_serving.py`` adds HTTP on top).

Usage:
    .venv/bin/python benchmarks/bench_offline.py --num-requests 32 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

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


def run(engine: Any, reqs: list[tuple[str, list[int]]], params: Any, deadline: float,
        max_steps: int) -> tuple[int, list[float], dict[str, float]]:
    """Add every request, step until all are finished; returns (generated tokens, step
    times, time to each request's first token)."""
    step_times: list[float] = []
    first_token: dict[str, float] = {}
    generated = 0
    t0 = time.perf_counter()
    for rid, ids in reqs:
        engine.add_request(rid, ids, params)
    while engine.has_unfinished_requests():
        if time.perf_counter() > deadline or len(step_times) >= max_steps:
            raise TimeoutError(f"gave up after {len(step_times)} steps or the deadline")
        s0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        step_times.append(now - s0)
        for o in outs:
            generated += len(o.new_token_ids)
            if o.new_token_ids and o.request_id not in first_token:
                first_token[o.request_id] = now - t0
    return generated, step_times, first_token


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--model", help="GGUF file or safetensors dir (default: backends.models.default_model_path())")
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=0, help="backend threads (0: backend default)")
    p.add_argument("--passes", default=None,
                   help='JSON of the load passes, e.g. \'{"quantise": "native"}\' (default: the backend\'s)')
    p.add_argument("--no-decode-loop", action="store_true",
                   help="run every step's layers from Python (drop the C++ decode loop the decode_loop pass made)")
    p.add_argument("--num-requests", "-n", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--engine-config", default="{}", help="JSON of extra EngineConfig fields")
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline for the measured run (s)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    from inferflux.backends.base import ModelSpec
    from inferflux.backends.engine import EngineConfig, LLMEngine, SamplingParams
    from inferflux.backends.models import default_model_path, open_model
    from inferflux.backends.registry import get_backend

    path = args.model or default_model_path()
    t_load = time.perf_counter()
    cls = get_backend(args.backend)
    backend = cls(num_threads=args.threads) if args.threads else cls()
    info = backend.load(ModelSpec(name=Path(path).stem, path=path, dtype=args.dtype,
                                  passes=json.loads(args.passes) if args.passes else None))
    model = getattr(backend, "model", None)
    decode_loop = getattr(model, "decode_loop", None) is not None
    if args.no_decode_loop and decode_loop:
        model.decode_loop, decode_loop = None, False
    tokenizer = open_model(path).tokenizer()
    timed = TimedForward(backend)
    backend.forward = timed  # instance attribute shadows the method
    # max_num_seqs = N: every request may run in the same batch.
    cfg = EngineConfig(**{"max_num_seqs": args.num_requests, **json.loads(args.engine_config)})
    engine = LLMEngine(backend, tokenizer, info, cfg)
    load_s = time.perf_counter() - t_load

    prompts, counts = build_prompts(args.num_requests + 1, args.prompt_tokens, _Tok(tokenizer))
    ids = [tokenizer.encode(t, add_special_tokens=False)[: args.prompt_tokens] for t in prompts]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    params.validate(info.vocab_size)
    max_steps = args.num_requests * (args.prompt_tokens + args.output_tokens) + 1000

    if not args.no_warmup:  # one short request: first-call costs (allocation, kernels) out of the timing
        timed.enabled = False
        warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        run(engine, [("warmup", ids[-1])], warm, time.perf_counter() + 300.0, max_steps)
        timed.enabled = True

    reqs = [(f"r{i}", ids[i]) for i in range(args.num_requests)]
    sys0, me0 = _system_cpu(), _self_cpu()
    t0 = time.perf_counter()
    generated, step_times, first_token = run(engine, reqs, params, time.perf_counter() + args.timeout, max_steps)
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
        "model": path, "dtype": info.dtype, "backend": args.backend, "passes": args.passes,
        "decode_loop": decode_loop,
        "engine_config": repr(cfg),
        "num_requests": args.num_requests, "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "load_s": round(load_s, 2),
        "wall_s": round(wall, 3), "generated_tokens": generated,
        "generated_tok_s": round(generated / wall, 2) if wall else None,
        "total_tok_s": round((generated + args.num_requests * args.prompt_tokens) / wall, 2) if wall else None,
        "steps": len(step_times),
        "step_ms": {q: pct(ms(step_times), q) for q in (50, 90, 99)},
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
          f"passes {args.passes or 'default'}, decode loop {'on' if decode_loop else 'off'}, LLMEngine.step")
    print(f"{args.num_requests} requests x ({args.prompt_tokens} prompt + {args.output_tokens} generated): "
          f"{generated} tokens in {wall:.2f}s = {result['generated_tok_s']} generated tok/s "
          f"({result['total_tok_s']} incl. prompt)")
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
