#!/usr/bin/env python3
"""Continuous batching against a static-batching baseline, on the same engine and requests.

The seeds' claim (Mini-Infer: continuous batching 2-3x static) holds when output lengths
vary: a static batch runs until its longest member is done while the finished members'
seats stay empty, and the next batch waits for it. So the requests here get output
lengths drawn (seeded) uniformly from ``[--min-output, --max-output]`` (``ignore_eos``:
each runs exactly its length), and there are more of them than seats.

- continuous: every request is added at once; the scheduler keeps up to ``--batch``
  sequences running and admits a waiting one as soon as a seat frees (the engine as served).
- static: the requests go in groups of ``--batch``; a group is added, stepped until all
  of it is finished, then the next group is added.

Both run in one process on one loaded model and one ``LLMEngine`` (same backend, same KV
cache, same ``max_num_seqs``), alternating over ``--rounds``; the figures are medians.
Also reported: mean KV slot utilisation over the steps (``EngineStats.kv_slot_utilisation``)
and the mean number of running sequences per step.

Usage:
    .venv/bin/python benchmarks/bench_batching.py --json benchmarks/results/results-2026-11-26-batching.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offline import _Tok  # noqa: E402
from bench_serving import _self_cpu, _system_cpu, build_prompts, machine_info  # noqa: E402

Request = tuple[str, list[int], Any]  # id, prompt ids, SamplingParams


def step_until_done(engine: Any, seen: dict[str, float], t0: float, stats: list[tuple[float, int]],
                    deadline: float) -> int:
    """Step ``engine`` until it has nothing left; returns tokens generated."""
    generated = 0
    while engine.has_unfinished_requests():
        if time.perf_counter() > deadline:
            raise TimeoutError("deadline reached")
        for out in engine.step():
            generated += len(out.new_token_ids)
            if out.new_token_ids and out.request_id not in seen:
                seen[out.request_id] = time.perf_counter() - t0
        s = engine.stats()
        stats.append((s.kv_slot_utilisation, s.num_running))
    return generated


def run_mode(engine: Any, mode: str, reqs: list[Request], batch: int, deadline: float) -> dict[str, Any]:
    first: dict[str, float] = {}
    stats: list[tuple[float, int]] = []
    generated = 0
    t0 = time.perf_counter()
    groups = [reqs] if mode == "continuous" else [reqs[i : i + batch] for i in range(0, len(reqs), batch)]
    for group in groups:
        for rid, ids, params in group:
            engine.add_request(rid, ids, params)
        generated += step_until_done(engine, first, t0, stats, deadline)
    wall = time.perf_counter() - t0
    return {
        "mode": mode, "wall_s": round(wall, 3), "generated_tokens": generated,
        "generated_tok_s": round(generated / wall, 2), "steps": len(stats),
        "mean_running": round(statistics.fmean(n for _, n in stats), 2),
        "mean_kv_slot_utilisation": round(statistics.fmean(u for u, _ in stats), 4),
        "ttft_s_p50": round(statistics.median(first.values()), 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="GGUF file or safetensors dir (default: backends.models.default_model_path())")
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--num-requests", "-n", type=int, default=48)
    p.add_argument("--batch", type=int, default=16, help="seats: max_num_seqs, and the static batch size")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline for each mode's run (s)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    from inferflux.backends.base import ModelSpec
    from inferflux.backends.engine import EngineConfig, LLMEngine, SamplingParams
    from inferflux.backends.models import default_model_path, open_model
    from inferflux.backends.registry import get_backend

    path = args.model or default_model_path()
    backend = get_backend("cpu")()
    info = backend.load(ModelSpec(name=Path(path).stem, path=path, dtype=args.dtype))
    tokenizer = open_model(path).tokenizer()
    engine = LLMEngine(backend, tokenizer, info, EngineConfig(max_num_seqs=args.batch))

    prompts, _ = build_prompts(args.num_requests, args.prompt_tokens, _Tok(tokenizer))
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_output, args.max_output) for _ in prompts]

    def requests(tag: str) -> list[Request]:
        out = []
        for i, (text, n) in enumerate(zip(prompts, lengths)):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            params.validate(info.vocab_size)
            out.append((f"{tag}-{i}", tokenizer.encode(text, add_special_tokens=False)[: args.prompt_tokens], params))
        return out

    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("warmup", requests("w")[0][1], warm)
    step_until_done(engine, {}, time.perf_counter(), [], time.perf_counter() + 300)

    runs: list[dict[str, Any]] = []
    sys0, me0, t_all = _system_cpu(), _self_cpu(), time.perf_counter()
    for rnd in range(args.rounds):
        order = ("continuous", "static") if rnd % 2 == 0 else ("static", "continuous")
        for mode in order:
            try:
                r = run_mode(engine, mode, requests(f"{mode}{rnd}"), args.batch, time.perf_counter() + args.timeout)
            except TimeoutError:
                raise SystemExit(f"round {rnd} {mode}: not finished within --timeout {args.timeout:.0f} s "
                                 f"(load average {Path('/proc/loadavg').read_text().split()[0]})") from None
            r["round"] = rnd
            print(f"[batching] round {rnd} {mode:<10} {r['generated_tok_s']:8.1f} tok/s  wall {r['wall_s']:.1f}s  "
                  f"steps {r['steps']}  mean running {r['mean_running']}  KV util "
                  f"{r['mean_kv_slot_utilisation']:.1%}  TTFT p50 {r['ttft_s_p50']}s", file=sys.stderr)
            runs.append(r)
    wall = time.perf_counter() - t_all
    sys1, me1 = _system_cpu(), _self_cpu()
    cpu_self = (me1 - me0) / wall
    cpu_other = max(0.0, (sys1[0] - sys0[0]) / wall - cpu_self) if sys1[1] else None

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    ratio = med("continuous", "generated_tok_s") / med("static", "generated_tok_s")
    summary = {m: {k: med(m, k) for k in ("generated_tok_s", "wall_s", "steps", "mean_running",
                                          "mean_kv_slot_utilisation", "ttft_s_p50")}
               for m in ("continuous", "static")}
    print("| mode | generated tok/s | wall (s) | steps | mean running | KV slots used/allocated | TTFT p50 (s) |")
    print("|---|---|---|---|---|---|---|")
    for m, s in summary.items():
        print(f"| {m} | {s['generated_tok_s']:.1f} | {s['wall_s']:.1f} | {s['steps']:.0f} | {s['mean_running']:.1f} "
              f"| {s['mean_kv_slot_utilisation']:.1%} | {s['ttft_s_p50']:.2f} |")
    # Steps for the same tokens: the ratio that the machine's load does not move (a step's time does).
    step_ratio = med("static", "steps") / med("continuous", "steps")
    print(f"continuous / static generated tok/s: {ratio:.2f}x; static / continuous steps: {step_ratio:.2f}x; "
          f"CPU: this process {cpu_self:.2f} cores, "
          f"other processes {cpu_other if cpu_other is None else round(cpu_other, 2)} cores")
    if args.json:
        result = {"machine": machine_info(), "model": path, "dtype": info.dtype,
                  "loadavg": Path("/proc/loadavg").read_text().split()[:3],
                  "workload": {"num_requests": args.num_requests, "batch": args.batch,
                               "prompt_tokens": args.prompt_tokens, "output_tokens": [args.min_output, args.max_output],
                               "seed": args.seed, "rounds": args.rounds, "output_lengths": lengths},
                  "summary": summary, "ratio_continuous_over_static": round(ratio, 3),
                  "ratio_static_over_continuous_steps": round(step_ratio, 3), "runs": runs,
                  "cpu_cores_self": round(cpu_self, 2),
                  "cpu_cores_other": None if cpu_other is None else round(cpu_other, 2)}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
