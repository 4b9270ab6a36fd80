#!/usr/bin/env python3
"""Soak benchmark: the gateway's RSS over minutes of mixed load with abandoned streams.

Starts ``inferctl serve`` (through ``tests/support/soak_server.py``, which adds a
memory probe on SIGUSR1; float32, 32 MiB of KV, loopback only) and runs rounds
of load until ``--minutes`` have passed: each round abandons ``--aborted``
streams (closed before the answer, after its head, or mid-generation) and
completes ``--completed`` requests (half streamed). Every ``--sample-seconds``
it asks the gateway for its RSS twice: as it is, and after ``gc.collect()`` and
``malloc_trim(0)``. At the end it prints the method, the CPU, every sample, and
whether the trimmed RSS stayed within ``--tolerance`` (5%) of its value at
``--warmup-minutes`` (5) for the rest of the run.

The gateway inherits this process's environment, so e.g.
``MALLOC_ARENA_MAX=2 benchmarks/bench_soak.py`` measures glibc with fewer arenas.
See docs/benchmarks.md for results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests" / "support"))  # the soak helpers, shared with the CI soak test

from soak import completed, probe, start_gateway, storm, wait_idle  # noqa: E402

from inferflux.policy.authn.apikeys import generate_key  # noqa: E402

MiB = 1024 * 1024


def cpu_description() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.1f} at start"


def within(samples: list[dict[str, Any]], warmup_s: float, tolerance: float) -> tuple[bool | None, float | None]:
    """Whether every trimmed RSS sample after the warm-up is within ``tolerance`` of the first one after it."""
    after = [s["rss"] for s in samples if s["t"] >= warmup_s]
    if len(after) < 2:
        return None, None
    base = after[0]
    worst = max(abs(r - base) for r in after) / base
    return worst <= tolerance, worst


async def run(args: argparse.Namespace) -> dict[str, Any]:
    key = generate_key().token
    work = Path(tempfile.mkdtemp(prefix="inferflux-soak-"))
    gateway = start_gateway(work / "data", key, work / "gateway.log")
    samples: list[dict[str, Any]] = []
    totals: dict[str, int] = {}
    start = time.monotonic()
    next_sample = 0.0
    rounds = 0
    try:
        while True:
            elapsed = time.monotonic() - start
            if elapsed >= next_sample:
                await wait_idle(gateway.url)
                report = probe(gateway)
                sample = {
                    "t": round(time.monotonic() - start, 1), "rounds": rounds,
                    "rss": report["rss"], "rss_before_trim": report["rss_before_trim"], "threads": report["threads"],
                    "malloc_in_use": report["malloc_in_use"], "python_blocks": report["python_blocks"],
                }  # fmt: skip
                samples.append(sample)
                print(f"  t={sample['t']:7.1f}s rounds={rounds:4d} rss={report['rss'] / MiB:8.1f} MiB "
                      f"(before trim {report['rss_before_trim'] / MiB:8.1f}) threads={report['threads']} "
                      f"malloc in use={(report['malloc_in_use'] or 0) / MiB:8.1f} MiB "
                      f"python blocks={report['python_blocks']}", flush=True)
                next_sample += args.sample_seconds
            if elapsed >= args.minutes * 60:
                break
            first = rounds * (args.aborted + args.completed)
            for outcome, n in (await storm(gateway.url, key, args.aborted, args.concurrency, first=first)).items():
                totals[f"abandoned: {outcome}"] = totals.get(f"abandoned: {outcome}", 0) + n
            done = await completed(gateway.url, key, args.completed, first=first + args.aborted)
            for outcome, n in done.items():
                totals[f"completed: {outcome}"] = totals.get(f"completed: {outcome}", 0) + n
            rounds += 1
    finally:
        gateway.stop()
    ok, worst = within(samples, args.warmup_minutes * 60, args.tolerance)
    return {
        "method": (
            f"rounds of {args.aborted} abandoned streams (concurrency {args.concurrency}) and {args.completed} "
            f"completed requests for {args.minutes} min; RSS after gc + malloc_trim every {args.sample_seconds} s"
        ),
        "cpu": cpu_description(),
        "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
        "minutes": args.minutes,
        "rounds": rounds,
        "requests": totals,
        "samples": samples,
        "within_tolerance_after_warmup": ok,
        "worst_deviation_after_warmup": worst,
        "load_average_at_end": os.getloadavg()[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to run (default: %(default)s)")
    parser.add_argument("--warmup-minutes", type=float, default=5.0, help="not judged (default: %(default)s)")
    parser.add_argument("--sample-seconds", type=float, default=30.0, help="RSS sample interval (default: %(default)s)")
    parser.add_argument("--aborted", type=int, default=40, help="abandoned streams per round (default: %(default)s)")
    parser.add_argument("--completed", type=int, default=10, help="completed requests per round (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=16, help="abandoned streams at once (default: %(default)s)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="allowed RSS drift (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}; Python {platform.python_version()}", flush=True)
    result = asyncio.run(run(args))
    print(f"method: {result['method']}")
    print(f"requests: {result['requests']}")
    verdict = result["within_tolerance_after_warmup"]
    worst = result["worst_deviation_after_warmup"]
    print(
        "RSS within {:.0%} after the warm-up: {}".format(
            args.tolerance, "n/a (run too short)" if verdict is None else f"{verdict} (worst {worst:.2%})"
        )
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
