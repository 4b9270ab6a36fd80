#!/usr/bin/env python3
"""Grammar engines for structured outputs, side by side: ``llguidance`` and ``xgrammar``.

Why this exists: constrained decoding (``response_format`` json_schema / json_object) needs a
token mask per sequence per decode step, computed from a grammar compiled per schema. Two
maintained engines are on PyPI; this measures both on the bundled model's own vocabulary
(SmolLM2-135M-Instruct, 49152 byte-level BPE tokens, read from the default GGUF by
``backends.models``) so the choice in ``backends/engine/guided.py`` rests on numbers. Rerun it
when either engine is upgraded. An engine that is not installed is skipped, with a note
(``pip install --no-deps xgrammar apache-tvm-ffi`` brings the loser into a venv for a rerun;
it needs torch and transformers, which the dev venv has).

Method
------
* **tokenizer**: wall time to build the engine's view of the vocabulary once per model
  (llguidance: ``LLTokenizer`` from the tokenizer's JSON; xgrammar: ``TokenizerInfo`` from a
  transformers fast tokenizer wrapping the same ``tokenizers`` object), one run each.
* **compile**: a nested JSON schema (objects in objects, an array of objects, enums,
  required fields, bounded strings and integers; ``SCHEMA`` below) compiled into a
  ready-to-use matcher, compact JSON (no free whitespace) as the engine serves it. Each run
  renames one property so no cache of either engine can answer (cold); ``--repeats`` runs,
  median and max wall time. Also the cost of a matcher from an already compiled grammar
  (what a cache hit costs a request): llguidance ``deep_copy`` of a matcher, xgrammar a new
  ``GrammarMatcher`` over the ``CompiledGrammar``.
* **mask per decode step**: ``--docs`` different documents that validate against the schema
  (compact JSON, random content from a fixed seed) are tokenised with the model's tokenizer,
  EOS appended. At batch B (1 and 32) B matchers walk B documents in lock step; each step
  fills the token bitmasks of every unfinished matcher ([B, ceil(vocab/32)] int32), then each
  matcher consumes its document's next token (checked allowed by its mask: both engines
  must accept every document). The fill is timed per step, in the engine's batch call
  (llguidance ``fill_next_token_bitmask_par`` on an ``LLExecutor``; xgrammar
  ``BatchGrammarMatcher.batch_fill_next_token_bitmask``) and one matcher at a time; the
  consume (advance) is timed on its own. Reported per step: median, p90 and mean wall
  milliseconds, over every step of ``--rounds`` walks.
* **apply**: what the engine's sampler does with a filled bitmask whatever the engine:
  unpack it and set disallowed logits to -inf on a [B, vocab] float32 array (numpy), median
  of ``--repeats``.

Wall time on a shared machine: the load average is recorded before and after, and the CPU
model comes from ``lscpu``.

Usage:
    .venv/bin/python benchmarks/bench_grammar.py [--repeats 15] [--rounds 3] [--docs 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from bench_dequant import cpu_name  # noqa: E402

from inferflux.backends.engine.guided import apply_bitmask  # noqa: E402
from inferflux.backends.models import default_model_path, open_model  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["person", "place", "thing"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "geo"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                               "size": {"enum": ["s", "m", "l"]}},
                "required": ["id", "ok"],
                "additionalProperties": False,
            },
            "maxItems": 3,
        },
    },
    "required": ["name", "kind", "address", "items"],
    "additionalProperties": False,
}
WORDS = ["alpha", "beta", "gamma", "delta", "paris", "oslo", "lima", "red", "green", "blue", "x", "hello world"]


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def finish(results: dict[str, Any], json_path: str | None) -> None:
    """Record the load average after the run; write the results where asked."""
    results["load_average_after"] = loadavg()
    print(f"load average after: {results['load_average_after']}")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def document(rng: np.random.Generator) -> dict[str, Any]:
    """A random document valid against ``SCHEMA``, its properties in the schema's order (both
    engines emit properties in that order)."""
    def word() -> str:
        return str(rng.choice(WORDS))

    doc: dict[str, Any] = {"name": word(), "kind": str(rng.choice(["person", "place", "thing"]))}
    if rng.random() < 0.5:
        doc["score"] = int(rng.integers(0, 101))
    if rng.random() < 0.5:
        doc["tags"] = [word()[:8] for _ in range(int(rng.integers(0, 5)))]
    address: dict[str, Any] = {"city": word()}
    if rng.random() < 0.5:
        address["zip"] = f"{int(rng.integers(0, 100_000)):05d}"
    address["geo"] = {"lat": round(float(rng.uniform(-90, 90)), 4), "lon": round(float(rng.uniform(-180, 180)), 4)}
    doc["address"] = address
    doc["items"] = []
    for _ in range(int(rng.integers(0, 4))):
        item: dict[str, Any] = {"id": int(rng.integers(0, 10_000)), "ok": bool(rng.integers(0, 2))}
        if rng.random() < 0.5:
            item["size"] = str(rng.choice(["s", "m", "l"]))
        doc["items"].append(item)
    return doc


def renamed(schema: dict[str, Any], i: int) -> dict[str, Any]:
    """``schema`` with an optional property of a new name at the end (the documents never
    have it): a schema no cache has seen, that accepts the same documents."""
    out = json.loads(json.dumps(schema))
    out["properties"][f"unused{i}"] = {"type": "boolean"}
    return out


def stats_ms(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    return {"median_ms": round(statistics.median(ms), 4), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 4),
            "mean_ms": round(statistics.fmean(ms), 4), "max_ms": round(ms[-1], 4), "n": len(ms)}


class Engine:
    """One grammar engine behind the few calls the benchmark makes."""

    name = ""

    def compile(self, schema: dict[str, Any]) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None: ...
    def fill_one(self, matcher: Any, bitmask: np.ndarray, index: int) -> None: ...
    def consume(self, matcher: Any, token: int) -> bool: ...


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, tok: Any, vocab: int) -> None:
        import llguidance
        import llguidance.numpy as lln

        self.ll, self.lln = llguidance, lln
        self.version = llguidance.get_version() if hasattr(llguidance, "get_version") else "?"
        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab,
                                                eos_token=sorted(tok.eos_token_ids))
        self.setup_s = time.perf_counter() - start
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        self.lln.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def fill_one(self, matcher: Any, bitmask: np.ndarray, index: int) -> None:
        self.lln.fill_next_token_bitmask(matcher, bitmask, index)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, tok: Any, vocab: int) -> None:
        import importlib.metadata

        import transformers
        import xgrammar

        self.xgr = xgrammar
        self.version = importlib.metadata.version("xgrammar")
        start = time.perf_counter()
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=sorted(tok.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.setup_s = time.perf_counter() - start
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_one(self, matcher: Any, bitmask: np.ndarray, index: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, index)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


def walk(engine: Engine, compiled: Any, docs: list[list[int]], batch: int, rounds: int, vocab: int,
         batched: bool, keep: list[np.ndarray] | None = None) -> dict[str, Any]:
    """Per-step fill and consume times of ``batch`` matchers walking ``docs`` in lock step: the
    first walk on its own (caches an engine fills lazily are cold), then the later ones.
    ``keep`` collects the filled bitmasks (for the apply measurement)."""
    fill: list[list[float]] = []
    consume: list[float] = []
    words = (vocab + 31) // 32
    for r in range(rounds):
        fill.append([])
        chosen = [docs[(r * batch + i) % len(docs)] for i in range(batch)]
        matchers = [engine.matcher(compiled) for _ in chosen]
        pos = [0] * batch
        while True:
            live = [i for i in range(batch) if pos[i] < len(chosen[i])]
            if not live:
                break
            bitmask = np.full((len(live), words), -1, dtype=np.int32)
            active = [matchers[i] for i in live]
            start = time.perf_counter()
            if batched:
                engine.fill_batch(active, bitmask)
            else:
                for j, m in enumerate(active):
                    engine.fill_one(m, bitmask, j)
            fill[-1].append(time.perf_counter() - start)
            if keep is not None:
                keep.extend(bitmask)
            for j, i in enumerate(live):
                token = chosen[i][pos[i]]
                if not (int(bitmask[j, token >> 5]) >> (token & 31)) & 1:
                    raise RuntimeError(f"{engine.name} masks out token {token} of a valid document at {pos[i]}")
            start = time.perf_counter()
            for i in live:
                if not engine.consume(matchers[i], chosen[i][pos[i]]):
                    raise RuntimeError(f"{engine.name} refused token {chosen[i][pos[i]]} of a valid document")
                pos[i] += 1
            consume.append(time.perf_counter() - start)
    return {"fill_first_walk": stats_ms(fill[0]), "fill_later_walks": stats_ms([t for f in fill[1:] for t in f]),
            "consume": stats_ms(consume)}


def bench_engine(engine: Engine, docs: list[list[int]], vocab: int, args: argparse.Namespace,
                 keep: list[np.ndarray] | None) -> dict[str, Any]:
    cold: list[float] = []
    for i in range(args.repeats):
        schema = renamed(SCHEMA, i)
        start = time.perf_counter()
        engine.compile(schema)
        cold.append(time.perf_counter() - start)
    compiled = engine.compile(SCHEMA)
    hits: list[float] = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        engine.matcher(compiled)
        hits.append(time.perf_counter() - start)
    out: dict[str, Any] = {"version": engine.version, "tokenizer_setup_s": round(engine.setup_s, 3),
                           "compile_cold": stats_ms(cold), "matcher_from_compiled": stats_ms(hits), "steps": {}}
    for batch in (1, 32):
        for batched in (True, False):
            key = f"batch{batch}_{'batched' if batched else 'serial'}"
            # a fresh grammar each time: every variant starts with cold caches
            fresh = engine.compile(renamed(SCHEMA, 10_000 + len(out["steps"])))
            out["steps"][key] = walk(engine, fresh, docs, batch, args.rounds, vocab, batched,
                                     keep if batch == 32 and batched else None)
    return out


def bench_apply(vocab: int, repeats: int, masks: list[np.ndarray]) -> dict[str, Any]:
    """The sampler's apply on real bitmasks (those a batch-32 walk filled), 32 or 1 at a time."""
    rng = np.random.default_rng(0)
    out = {}
    for batch in (1, 32):
        logits = rng.standard_normal((batch, vocab)).astype(np.float32)
        times = []
        for r in range(repeats):
            start_row = (r * batch * 7) % max(1, len(masks) - batch)
            bitmask = np.ascontiguousarray(np.stack(masks[start_row : start_row + batch]))
            start = time.perf_counter()
            apply_bitmask(logits, bitmask)
            times.append(time.perf_counter() - start)
        out[f"batch{batch}"] = stats_ms(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3, help="walks over the documents per batch size")
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--json", help="write the results here as well")
    args = ap.parse_args()

    source = open_model(default_model_path())
    tok, vocab = source.tokenizer(), source.config.vocab_size
    rng = np.random.default_rng(7)
    texts = [json.dumps(document(rng), separators=(",", ":")) for _ in range(args.docs)]
    eos = min(tok.eos_token_ids)  # either ends the walk; the engines allow all of them
    docs = [tok.encode(t, add_special_tokens=False) + [eos] for t in texts]
    results: dict[str, Any] = {
        "cpu": cpu_name(), "python": platform.python_version(), "numpy": np.__version__,
        "model": os.path.basename(default_model_path()), "vocab": vocab, "docs": args.docs,
        "doc_tokens_mean": round(statistics.fmean(len(d) for d in docs), 1), "repeats": args.repeats,
        "rounds": args.rounds, "load_average_before": loadavg(), "engines": {}, "skipped": {},
    }
    print(f"CPU: {results['cpu']}; load average {results['load_average_before']}; vocab {vocab}; "
          f"{args.docs} documents of {results['doc_tokens_mean']} tokens on average")
    makers: dict[str, Callable[[], Engine]] = {"llguidance": lambda: LLGuidance(tok, vocab),
                                               "xgrammar": lambda: XGrammar(tok, vocab)}
    masks: list[np.ndarray] = []
    for name, make in makers.items():
        try:
            engine = make()
        except ImportError as exc:
            results["skipped"][name] = f"not installed ({exc})"
            print(f"{name}: skipped, not installed")
            continue
        r = bench_engine(engine, docs, vocab, args, masks if not masks else None)
        results["engines"][name] = r
        print(f"\n{name} {r['version']}: tokenizer setup {r['tokenizer_setup_s']} s; compile (cold) median "
              f"{r['compile_cold']['median_ms']} ms, max {r['compile_cold']['max_ms']} ms; "
              f"matcher from a compiled grammar {r['matcher_from_compiled']['median_ms']} ms")
        print("  fill per step (ms)   first walk: median    p90   mean |  later walks: median    p90   mean"
              " | consume median")
        for key, s in r["steps"].items():
            a, b = s["fill_first_walk"], s["fill_later_walks"]
            print(f"  {key:<18} {a['median_ms']:17.3f} {a['p90_ms']:6.3f} {a['mean_ms']:6.3f} | "
                  f"{b['median_ms']:20.3f} {b['p90_ms']:6.3f} {b['mean_ms']:6.3f} | {s['consume']['median_ms']:.3f}")
    if masks:
        results["apply_numpy"] = bench_apply(vocab, args.repeats, masks)
        print(f"\napply real bitmasks to [B, {vocab}] float32 logits (numpy, the sampler's own): "
              + ", ".join(f"{k} median {v['median_ms']} ms" for k, v in results["apply_numpy"].items()))
    finish(results, args.json)


if __name__ == "__main__":
    main()
