#!/usr/bin/env python3
"""The throughput cost of deterministic mode (batch-invariant kernels, issue 22 point 5).

Method: one process loads the model twice on the cpu backend, deterministic off and on
(the same dtype and load passes), each with its own engine (prefix caching off, so a
repeated prompt is computed again). For each concurrency level (default 1 and 32 streams)
and round, both engines run the same greedy workload (``--prompt-tokens`` prompt,
``--output-tokens`` generated, ignore_eos, every request added at once), in alternating
order from round to round; generated tokens/s is generated tokens over the run's wall time
(prefill included, as a server's clients see it). Reported: every round, the median per
mode and the cost ``1 - on / off`` of the medians. Engine only: no HTTP.

Usage:
    .venv/bin/python benchmarks/bench_invariance.py --rounds 3 --json benchmarks/results/results-...json
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

from bench_offline import _Tok, run  # noqa: E402
from bench_serving import build_prompts, machine_info  # noqa: E402

MODES = ("off", "on")


def _load(path: str, dtype: str, quantise: str | None, deterministic: bool, max_seqs: int) -> tuple[Any, Any]:
    from inferflux.backends.base import ModelSpec
    from inferflux.backends.cpu import CPUBackend
    from inferflux.backends.engine import EngineConfig, LLMEngine
    from inferflux.backends.models import open_model

    backend = CPUBackend()
    spec = ModelSpec(name=Path(path).stem, path=path, dtype=dtype, deterministic=deterministic,
                     passes={"quantise": quantise} if quantise else None)
    info = backend.load(spec)
    engine = LLMEngine(backend, open_model(path).tokenizer(), info,
                       EngineConfig(max_num_seqs=max_seqs, enable_prefix_caching=False))
    return engine, info


def _loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="GGUF file or safetensors dir (default: backends.models.default_model_path())")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--quantise", help="the load passes' quantise mode (default: the backend's, auto)")
    p.add_argument("--streams", default="1,32", help="comma-separated concurrency levels")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the backend's default)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from inferflux.backends.engine import SamplingParams
    from inferflux.backends.models import default_model_path

    path = args.model or default_model_path()
    levels = [int(x) for x in args.streams.split(",")]
    engines = {mode: _load(path, args.dtype, args.quantise, mode == "on", max(levels)) for mode in MODES}
    tokenizer = engines["off"][0].tokenizer
    prompts, _ = build_prompts(max(levels) + 1, args.prompt_tokens, _Tok(tokenizer))
    ids = [tokenizer.encode(t, add_special_tokens=False)[: args.prompt_tokens] for t in prompts]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for engine, _ in engines.values():  # first-call costs out of the timing
        run(engine, [("warmup", ids[-1])], warm, time.perf_counter() + 600, 10_000)

    load_before = _loadavg()
    rounds: list[dict[str, Any]] = []
    for level in levels:
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                engine = engines[mode][0]
                reqs = [(f"{mode}-{level}-{r}-{i}", ids[i]) for i in range(level)]
                t0 = time.perf_counter()
                generated, steps, _ = run(engine, reqs, params, time.perf_counter() + 1800, 1_000_000)
                wall = time.perf_counter() - t0
                rounds.append({"streams": level, "round": r, "mode": mode, "generated": generated,
                               "wall_s": round(wall, 3), "tok_s": round(generated / wall, 2), "load": _loadavg()[:1]})
                print(f"streams {level:>3} round {r} deterministic {mode:<3} {generated / wall:8.2f} tok/s "
                      f"({generated} tokens, {wall:.2f} s, load {rounds[-1]['load']})", flush=True)
    summary = {}
    for level in levels:
        med = {mode: statistics.median(x["tok_s"] for x in rounds if x["streams"] == level and x["mode"] == mode)
               for mode in MODES}
        summary[str(level)] = {"off_tok_s": med["off"], "on_tok_s": med["on"],
                               "cost": round(1 - med["on"] / med["off"], 3)}
        print(f"streams {level:>3}: off {med['off']:.2f}, on {med['on']:.2f} tok/s (medians of {args.rounds}): "
              f"cost {summary[str(level)]['cost'] * 100:.1f} %")
    info = engines["off"][1]
    result = {
        "method": __doc__.split("Usage:")[0].strip(),
        "machine": machine_info(), "loadavg_before": load_before, "loadavg_after": _loadavg(),
        "model": path, "dtype": info.dtype, "passes": [dict(x) for x in info.passes],
        "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "threads": args.threads or None,
        "rounds": rounds,
        "summary": summary,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
