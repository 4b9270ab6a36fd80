#!/usr/bin/env python3
"""Time to first token with a warm versus a cold shared prefix (prefix caching).

Method
------
The bundled SmolLM2 on the CPU backend, driven in-process through ``LLMEngine``
(no HTTP). Every request is a shared system prompt of ``--system-tokens`` tokens
followed by a short question of its own (a different question each time), and
asks for one token, so its latency is its time to first token: the prefill.
Two engines over the same loaded weights alternate, one request at a time:

* ``cold``: prefix caching off, so every request prefills the whole prompt;
* ``warm``: prefix caching on, the system prompt cached by one warm-up request,
  so a request prefills only its question.

Reported: median and p90 TTFT over ``--requests`` requests per engine, and the
ratio of the medians.

Usage:
    .venv/bin/python benchmarks/bench_prefix.py [--system-tokens 512] [--requests 20] [--dtype auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any


from inferflux.backends.base import ModelSpec  # noqa: E402
from inferflux.backends.cpu import CPUBackend  # noqa: E402
from inferflux.backends.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from inferflux.backends.models import default_model_path, open_model  # noqa: E402

from bench_auth import pct  # noqa: E402  (this folder is on sys.path)

SYSTEM_TEXT = (
    "You are the assistant of a municipal library. Members may borrow up to twelve items for three weeks; "
    "renewals are possible twice unless someone reserved the item. Late returns cost ten cents a day. "
    "The reading room is quiet; group rooms can be booked a week ahead. "
) * 40
QUESTIONS = [f" Question {i}: how many items can I borrow, and what if I return item {i} late? Answer:"
             for i in range(1000)]


def ttft(engine: LLMEngine, request_id: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = open_model(default_model_path()).tokenizer()
    backend = CPUBackend()
    info = backend.load(ModelSpec(name="smollm2", path=default_model_path(), dtype=args.dtype))
    system = tokenizer.encode(SYSTEM_TEXT)[: args.system_tokens]
    if len(system) < args.system_tokens:
        raise SystemExit(f"the system text has only {len(system)} tokens")
    questions = [tokenizer.encode(q, add_special_tokens=False) for q in QUESTIONS]
    # One engine at a time owns the backend's KV tensors: switching re-allocates
    # them, so each engine is built afresh with its cache state below.
    config = {"kv_cache_bytes": 64 << 20, "max_num_batched_tokens": 1024}
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    q = iter(questions)
    for i in range(args.requests):
        for name in ("cold", "warm") if i % 2 == 0 else ("warm", "cold"):
            engine = LLMEngine(backend, tokenizer, info, EngineConfig(enable_prefix_caching=name == "warm", **config))
            if name == "warm":
                ttft(engine, "warm-up", system + next(q))  # caches the system prompt's full blocks
            times[name].append(ttft(engine, f"{name}-{i}", system + next(q)))
            if name == "warm" and engine.stats().prefix_cache_hit_tokens < len(system) - engine.block_size:
                raise SystemExit("the warm engine did not reuse the system prompt")
    cold, warm = statistics.median(times["cold"]), statistics.median(times["warm"])
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
        "dtype": info.dtype, "system_tokens": len(system), "requests": args.requests,
        "cold": {"p50_ms": cold * 1000, "p90_ms": pct(times["cold"], 90) * 1000},
        "warm": {"p50_ms": warm * 1000, "p90_ms": pct(times["warm"], 90) * 1000},
        "speedup_p50": cold / warm,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("Method")[0].strip())
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=20, help="requests per engine")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    report = run(args)
    print(__doc__.split("Usage:")[0].strip())
    print()
    print(f"{report['system_tokens']}-token shared prefix, {report['requests']} requests per engine, {report['dtype']}")
    print("| prefix | TTFT p50 ms | p90 ms |")
    print("|---|---|---|")
    for name in ("cold", "warm"):
        print(f"| {name} | {report[name]['p50_ms']:.1f} | {report[name]['p90_ms']:.1f} |")
    print(f"\nwarm prefix: time to first token {report['speedup_p50']:.1f}x shorter at p50")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
