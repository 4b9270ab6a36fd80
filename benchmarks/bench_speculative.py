#!/usr/bin/env python3
"""Single-stream decode speed with speculative decoding, on input-grounded prompts.

Method
------
The bundled SmolLM2 on the CPU backend, driven in-process through ``LLMEngine``
(no HTTP), one request at a time. The prompts ask the model to reproduce or
lightly edit a text it is given (a code edit, a copied list, a quoted passage):
the workloads prompt-lookup speculation is for. Each prompt is decoded greedily
(up to ``--max-tokens``) by engines over the same weights: ``plain``, ``ngram``
(speculation with ``k = --k``) and, with ``--draft-layers N``, ``self-draft``
(draft method with the model's first N layers as the draft). They alternate
prompt by prompt over ``--rounds`` rounds (the order reversed every other run).
Decode speed is generated tokens after the first divided by the time from the
first token to the last (prefill excluded); the report gives the median over
all prompt x round runs of each engine, its ratio to plain, its acceptance
rate, and whether it produced the same tokens as plain.

Usage:
    .venv/bin/python benchmarks/bench_speculative.py [--k 4] [--max-tokens 128] [--rounds 3] [--dtype auto]
        [--draft-layers N] [--json out.json]
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
from inferflux.backends.engine.speculative import SpeculativeConfig  # noqa: E402
from inferflux.backends.models import default_model_path, open_model  # noqa: E402

CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    averages = []
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
'''
PASSAGE = (
    "The library opens at nine in the morning and closes at six in the evening. Members may borrow up to "
    "twelve items at a time for three weeks, and may renew them twice unless another member has reserved them. "
    "Late returns cost ten cents a day per item."
)
PROMPTS = [
    [{"role": "user", "content": f"Rename the variable `total` to `running_sum` in this function. Reply with the "
                                 f"whole function only.\n\n{CODE}"}],
    [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{PASSAGE}"}],
    [{"role": "user", "content": f"Add a docstring to this function and reply with the whole function:\n\n{CODE}"}],
    [{"role": "user", "content": "Copy this list exactly, one item per line: apples, pears, plums, cherries, "
                                 "grapes, lemons, limes, oranges, peaches, apricots, figs, dates."}],
]


def decode(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens and decode speed (tokens/s after the first token)."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens: list[int] = []
    first = last = 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if not tokens:
                first = now
            tokens += out.new_token_ids
            last = now
    return tokens, (len(tokens) - 1) / (last - first) if last > first else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    source = open_model(default_model_path())
    tokenizer = source.tokenizer()
    backend = CPUBackend()
    info = backend.load(ModelSpec(name="smollm2", path=default_model_path(), dtype=args.dtype))
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template(m, add_generation_prompt=True), add_special_tokens=False)
        for m in PROMPTS
    ]
    configs = {"plain": None, "ngram": SpeculativeConfig(k=args.k)}
    if args.draft_layers:
        configs["self-draft"] = SpeculativeConfig(method="draft", draft_layers=args.draft_layers, k=args.k)
    speeds: dict[str, list[float]] = {name: [] for name in configs}
    outputs: dict[tuple[str, int], list[int]] = {}
    proposed = dict.fromkeys(configs, 0)
    accepted = dict.fromkeys(configs, 0)
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            order = list(configs) if (r + i) % 2 == 0 else list(reversed(configs))
            for name in order:
                # A fresh engine per run: no prefix cache or warm state carried between the two.
                engine = LLMEngine(backend, tokenizer, info, EngineConfig(
                    kv_cache_bytes=64 << 20, speculative=configs[name], enable_prefix_caching=False))
                tokens, speed = decode(engine, f"{name}-{r}-{i}", prompt, args.max_tokens)
                speeds[name].append(speed)
                outputs[(name, i)] = tokens
                stats = engine.stats()
                proposed[name] += stats.spec_proposed_tokens
                accepted[name] += stats.spec_accepted_tokens
    plain = statistics.median(speeds["plain"])
    engines = {
        name: {
            "tokens_per_s": statistics.median(speeds[name]),
            "speedup": statistics.median(speeds[name]) / plain,
            "acceptance_rate": accepted[name] / proposed[name] if proposed[name] else 0.0,
            "same_tokens": all(outputs[("plain", i)] == outputs[(name, i)] for i in range(len(prompts))),
        }
        for name in configs
    }
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
        "dtype": info.dtype, "k": args.k, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "prompts": len(prompts), "draft_layers": args.draft_layers,
        "engines": engines,
        "per_run": speeds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("Method")[0].strip())
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--draft-layers", type=int, default=0, help="also run a self-draft of this many layers")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    report = run(args)
    print(__doc__.split("Usage:")[0].strip())
    print()
    print(f"{report['prompts']} prompts x {report['rounds']} rounds, greedy, up to {report['max_tokens']} tokens, "
          f"{report['dtype']}, k = {report['k']}")
    print("| engine | decode tokens/s (median) | speed-up | acceptance | same tokens as plain |")
    print("|---|---|---|---|---|")
    for name, e in report["engines"].items():
        print(f"| {name} | {e['tokens_per_s']:.1f} | {e['speedup']:.2f}x | {e['acceptance_rate']:.2f} | "
              f"{e['same_tokens']} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
