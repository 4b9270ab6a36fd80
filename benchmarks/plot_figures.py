#!/usr/bin/env python3
"""Draw docs/benchmarks.md's per-CPU plots from the result files under benchmarks/results/.

    .venv/bin/python benchmarks/plot_figures.py [--out docs/img]

writes ``policy-chain-per-cpu.svg`` (what the policy chain adds end to end at p50, each run's
median of its request pairs with the 95 % interval) and ``serving-vs-llama-per-cpu.svg``
(InferFlux's generated tokens/s over llama-server's in the same run, at 1 and 32 streams).

The two tables below name, per CPU, the runs the page quotes: a new CPU, or a new run on one,
is a line here and a rerun of this script. matplotlib comes with the dev extra, as for
``bench_serving.py --plots``; the SVGs are written without a date, so a rerun over the same
files changes nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"

# CPU (as docs/benchmarks.md names it) -> the bench_policy.py runs quoted for it, oldest first.
POLICY_RUNS: dict[str, list[str]] = {
    "AMD EPYC, AVX-512 BF16": [
        "results-2026-11-26-policy-paired.json",
        "results-2026-11-26-policy-amd-stop33.json",
        "results-2026-11-27-policy-amd-epyc-stop40-auto.json",
        "results-2026-11-27-policy-amd-epyc-stop40-float32.json",
    ],
    "AMD EPYC, AVX2 only": [
        "results-2026-11-27-policy-amd-zen3-after.json",
        "results-2026-11-28-policy-amd-zen3-stop42.json",
        "results-2026-11-29-policy-amd-zen3-stop45-run1.json",
        "results-2026-11-29-policy-amd-zen3-stop45-decode.json",
        "results-2026-11-29-policy-amd-zen3-stop45.json",
    ],
    "Intel Xeon 207, AMX": [
        "results-2026-11-26-policy-paired-intel.json",
        "results-2026-11-26-policy-intel-cold.json",
        "results-2026-11-27-policy-intel-207-stop38.json",
        "results-2026-11-27-policy-intel-207-stop41.json",
    ],
    "Intel Xeon 207, no BF16": ["results-2026-11-27-policy-intel-nobf16.json"],
    "Intel Xeon 167, AMX": [
        "results-2026-11-27-policy-intel-amx-before.json",
        "results-2026-11-27-policy-intel-amx-after.json",
        "results-2026-11-29-policy-intel-167-stop44.json",
        "results-2026-11-29-policy-intel-167-stop44-decode.json",
    ],
}

# CPU -> the bench_serving.py runs against llama-server with the defaults of the day, oldest first.
SERVING_RUNS: dict[str, list[str]] = {
    "AMD EPYC, AVX-512 BF16": [
        "results-2026-11-26-serving-exact-amd.json",
        "results-2026-11-26-serving-exact-2-amd.json",
    ],
    "Intel Xeon 207, no BF16": [
        "results-2026-11-27-serving-exact-f32-intel.json",
        "results-2026-11-27-serving-exact-f32-intel-4levels.json",
        "results-2026-11-27-serving-exact-f32-intel-1stream.json",
    ],
    "AMD EPYC, AVX2": ["results-2026-12-07-serving-avx2-blocks-zen3.json"],
    # Measured before the exact mode: the defaults then were dense bfloat16 weights, packed.
    "Intel Xeon 207, AMX (11-26)": ["results-2026-11-26-serving-packed-vs-llama-intel.json"],
}


def paired_runs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``paired`` figures of a bench_policy.py file's runs with the model generating (a file holds
    one run, or several under ``runs``; a ``--stand-in-engine`` run measures the chain hot, not this)."""
    runs = doc.get("runs", [doc])
    runs = runs.values() if isinstance(runs, dict) else runs
    return [run["paired"] for run in runs
            if isinstance(run, dict) and run.get("paired") and "stand-in" not in str(run.get("engine"))]


def serving_ratios(doc: dict[str, Any]) -> dict[int, float]:
    """Streams -> ours / peer generated tokens/s, for the levels where both servers finished."""
    ours, peer = doc["summary"].get("ours", {}), doc["summary"].get("peer", {})
    ratios = {}
    for level, row in ours.items():
        theirs = peer.get(level, {}).get("output_tok_s")
        if row.get("output_tok_s") and theirs:
            ratios[int(level)] = row["output_tok_s"] / theirs
    return ratios


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def plot_policy(out: Path) -> Path:
    plt = pyplot()
    cpus = list(POLICY_RUNS)
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(cpus) + 1.2))
    for row, cpu in enumerate(cpus):
        runs = [run for name in POLICY_RUNS[cpu] for run in paired_runs(load(name))]
        for offset, run in enumerate(runs):
            y = row + (offset - (len(runs) - 1) / 2) * 0.08
            low, high = run["added_p50_ci95_ms"]
            middle = run["added_p50_ms"]
            ax.errorbar(middle, y, xerr=[[middle - low], [high - middle]], fmt="o", color="C0", markersize=3,
                        elinewidth=0.8, capsize=2)
    ax.axvline(1.0, color="C3", linestyle="--", linewidth=1, label="target: 1 ms")
    ax.set_yticks(range(len(cpus)), cpus)
    ax.invert_yaxis()
    ax.set_xlabel("added end to end at p50, ms (median of the request pairs, 95 % interval)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="lower right")
    return save(fig, out / "policy-chain-per-cpu.svg")


def plot_serving(out: Path) -> Path:
    plt = pyplot()
    cpus = list(SERVING_RUNS)
    fig, axes = plt.subplots(1, 2, figsize=(8, 0.6 * len(cpus) + 1.4), sharey=True)
    for ax, streams, target in ((axes[0], 1, 1.0), (axes[1], 32, 3.0)):
        for row, cpu in enumerate(cpus):
            ratios = [r[streams] for name in SERVING_RUNS[cpu] if streams in (r := serving_ratios(load(name)))]
            ax.plot(ratios, [row] * len(ratios), "o", color="C0", markersize=4)
        ax.axvline(target, color="C3", linestyle="--", linewidth=1, label=f"target: {target:g}x")
        ax.margins(x=0.15)
        ax.set_title(f"{streams} stream{'s' if streams > 1 else ''}")
        ax.set_xlabel("InferFlux / llama-server, generated tok/s")
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(loc="upper left")
    axes[0].set_yticks(range(len(cpus)), cpus)
    axes[0].invert_yaxis()
    return save(fig, out / "serving-vs-llama-per-cpu.svg")


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "inferflux"  # element ids the same on every run
    matplotlib.rcParams["svg.fonttype"] = "none"  # text as text: small, and diffable
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Date": None})
    pyplot().close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "img", help="where the SVGs go")
    args = parser.parse_args()
    for path in (plot_policy(args.out), plot_serving(args.out)):
        print(path)


if __name__ == "__main__":
    main()
