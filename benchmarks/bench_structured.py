#!/usr/bin/env python3
"""What structured outputs cost the engine per decode step, and what they cost a step without them.

Why this exists: a guided sequence's grammar mask is computed and applied in the sampler
every step (``backends/engine/guided.py``), and the unconstrained path must not pay for it.
End-to-end throughput with and without a JSON schema is measured with ``bench_serving.py``
(its ``--extra-body``); docs/benchmarks.md has both.

Method
------
The sampler alone, in one process, on the bundled model's vocabulary (SmolLM2, 49152
tokens): B sequences (B = 1 and 32) and a fixed float32 logits array [B, vocab]. Each
timed step is what the engine does between a forward pass and the next: ``Sampler.sample``
over the B rows, then appending each row's token (for a guided sequence, the matcher
consuming it, as ``LLMEngine._push`` does). Four cases, run in turn step after step so a
shared machine's load falls on all of them alike:

* ``before``: the sampler and sequence modules of ``--baseline`` (a git revision before
  structured outputs, default ``b8e82e2^``, the parent of their first commit), loaded from git
  into a scratch package;
* ``plain``: today's sampler, no sequence guided (the unconstrained hot path);
* ``guided``: every sequence guided by a nested JSON schema (bench_grammar.py's ``SCHEMA``),
  each walking a different valid document (teacher forcing: the appended token is the
  document's next token, so the mask states are those of real output; the sampled token is
  discarded);
* ``biased``: every sequence with a 300-entry ``logit_bias`` (OpenAI's maximum).

Greedy (temperature 0) and sampled (temperature 1) rows separately. Reported per case: the
median and mean milliseconds per step over ``--steps`` steps (the documents restart when
they end), and guided - plain. The CPU model comes from ``lscpu``; the load average is
recorded before and after.

Usage:
    .venv/bin/python benchmarks/bench_structured.py [--steps 400] [--baseline REV] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from bench_grammar import SCHEMA, cpu_name, document, finish, loadavg  # noqa: E402

from inferflux.backends.engine import GuidedSpec, SamplingParams, Sequence  # noqa: E402
from inferflux.backends.engine.grammar_compiler import GrammarCompiler  # noqa: E402
from inferflux.backends.engine.sampler import Sampler  # noqa: E402
from inferflux.backends.models import default_model_path, open_model  # noqa: E402


def baseline_modules(rev: str, scratch: Path) -> tuple[Any, Any]:
    """(Sampler, Sequence) of revision ``rev``, from a scratch package of its two modules."""
    package = scratch / "baseline_engine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("sampler", "sequence"):
        text = subprocess.run(["git", "show", f"{rev}:backends/engine/{name}.py"], cwd=REPO_ROOT, check=True,
                              capture_output=True, text=True).stdout  # fmt: skip
        (package / f"{name}.py").write_text(text)
    sys.path.insert(0, str(scratch))
    sampler = importlib.import_module("baseline_engine.sampler")
    sequence = importlib.import_module("baseline_engine.sequence")
    return sampler.Sampler, sequence.Sequence


def make_case(sampler: Any, seqs: list[Any], logits: np.ndarray, docs: list[list[int]] | None) -> Callable[[], None]:
    """One step of a case: sample the rows, then append a token to each sequence."""
    positions = [0] * len(seqs)

    def step() -> None:
        samples = sampler.sample(logits, seqs)
        for i, (seq, sample) in enumerate(zip(seqs, samples)):
            token = sample.token_id
            if docs is not None:
                doc = docs[i % len(docs)]
                if positions[i] == len(doc):  # the document is done: start it again
                    positions[i] = 0
                    seq.guide = seq.guide_source.guide()
                token = doc[positions[i]]
                positions[i] += 1
            seq.token_ids.append(token)
            seq.output_token_ids.append(token)
            if getattr(seq, "guide", None) is not None:
                seq.guide.consume(token)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--baseline", default="b8e82e2^",
                    help="git revision of the sampler before structured outputs (default: the parent of "
                    "their first commit)")
    ap.add_argument("--json", help="write the results here as well")
    args = ap.parse_args()

    source = open_model(default_model_path())
    tok, vocab = source.tokenizer(), source.config.vocab_size
    rng = np.random.default_rng(3)
    docs = [tok.encode(json.dumps(document(rng), separators=(",", ":")), add_special_tokens=False)
            + [min(tok.eos_token_ids)] for _ in range(32)]  # fmt: skip
    grammars = GrammarCompiler(tok, vocab, tok.eos_token_ids)
    compiled = grammars.compile(GuidedSpec("json_schema", schema=SCHEMA))
    bias = {int(t): float(rng.uniform(-5, 5)) for t in rng.choice(vocab, size=300, replace=False)}
    scratch = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    OldSampler, OldSequence = baseline_modules(args.baseline, scratch)

    results: dict[str, Any] = {"cpu": cpu_name(), "vocab": vocab, "steps": args.steps, "baseline": args.baseline,
                               "load_average_before": loadavg(), "cases": {}}  # fmt: skip
    print(f"CPU: {results['cpu']}; load average {results['load_average_before']}; baseline {args.baseline}")
    for temperature in (0.0, 1.0):
        for batch in (1, 32):
            logits = rng.standard_normal((batch, vocab)).astype(np.float32)

            def seqs(cls: Any, **params: Any) -> list[Any]:
                return [cls(i, f"r{i}", [1, 2, 3], SamplingParams(temperature=temperature, seed=i, max_tokens=10**6,
                                                                  **params), max_tokens=10**6)
                        for i in range(batch)]  # fmt: skip

            guided = seqs(Sequence, guided=compiled.spec)
            for seq in guided:
                seq.guide_source = compiled
                seq.guide = compiled.guide()
            cases = {
                "before": make_case(OldSampler(tok.eos_token_ids), seqs(OldSequence), logits, None),
                "plain": make_case(Sampler(tok.eos_token_ids), seqs(Sequence), logits, None),
                "guided": make_case(Sampler(tok.eos_token_ids), guided, logits, docs),
                "biased": make_case(Sampler(tok.eos_token_ids), seqs(Sequence, logit_bias=bias), logits, None),
            }
            times: dict[str, list[float]] = {name: [] for name in cases}
            for step in cases.values():
                step()  # warm-up
            for _ in range(args.steps):
                for name, step in cases.items():
                    start = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - start)
            key = f"{'greedy' if temperature == 0 else 'sampled'}_batch{batch}"
            row: dict[str, Any] = {
                name: {"median_ms": round(statistics.median(t) * 1000, 4),
                       "mean_ms": round(statistics.fmean(t) * 1000, 4)}
                for name, t in times.items()
            }
            row["guided_minus_plain_mean_ms"] = round(row["guided"]["mean_ms"] - row["plain"]["mean_ms"], 4)
            row["plain_minus_before_median_ms"] = round(row["plain"]["median_ms"] - row["before"]["median_ms"], 4)
            results["cases"][key] = row
            print(f"{key:<16} " + "  ".join(f"{n} {v['median_ms']:.3f}/{v['mean_ms']:.3f}" for n, v in row.items()
                                             if isinstance(v, dict))
                  + f"  (median/mean ms)  guided-plain mean {row['guided_minus_plain_mean_ms']:+.3f} ms"
                  f"  plain-before median {row['plain_minus_before_median_ms']:+.4f} ms")
    finish(results, args.json)


if __name__ == "__main__":
    main()
