#!/usr/bin/env python3
"""How much Python the policy chain runs per request: bytecodes executed, by module, off and on.

Method
------
The apps of ``bench_policy.py`` (``off`` and ``on``) with the stand-in engine,
driven in-process one request at a time through ``httpx.ASGITransport``, as
there. After 30 warm-up requests, ``sys.settrace`` with opcode events on counts
every bytecode the event-loop thread executes during ``--requests`` requests,
by the file of its code; the report is the count per request, ``on`` minus
``off``, grouped (the benchmark's own client, each ``policy`` module, the
gateway, the rest).

Unlike a timing, the count is the same from run to run and CPU to CPU (within a
few hundred: periodic tasks that land inside it), so a change to the chain can be
measured exactly. It is not a time: a bytecode of the
chain costs two to four times as much in a served request (caches emptied by
the model's forward pass) as alone, C code (RE2, OpenSSL, the JSON encoder) is
not counted at all, only the Python that calls it, and a 14 % cut in the count
did not show in the request's time (docs/benchmarks.md, "Policy chain"; the run itself, stop 38,
is in that page's git history).

The client is the benchmark's, in the same thread: its part is what httpx does
with the ``on`` answers' six ``x-ratelimit-*`` headers (its cookie jar parses
every response's headers into an ``email.message``), which a real client does
in its own process.

Usage:
    .venv/bin/python benchmarks/opcodes_policy.py [--requests 20]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from bench_policy import body_for, setup  # noqa: E402  (this folder is on sys.path)

ROOT = str(Path(__file__).resolve().parent.parent) + "/"
STDLIB = str(Path(argparse.__file__).resolve().parent) + "/"
# What only the client runs in the standard library: its cookie jar, which parses every answer's headers.
_CLIENT_STDLIB = ("stdlib:email/", "stdlib:http/cookiejar.py", "stdlib:urllib/request.py")


def place(filename: str) -> str:
    """A code object's file as the report names it: a path in the project, a package, or a stdlib path."""
    if "/site-packages/" in filename:
        return "site:" + filename.split("/site-packages/", 1)[1].split("/", 1)[0]
    if filename.startswith(ROOT):
        return filename[len(ROOT) :]
    return "stdlib:" + filename.removeprefix(STDLIB)


def group(name: str) -> str:
    if name == "site:httpx" or name.startswith(_CLIENT_STDLIB):
        return "the benchmark's client (httpx, its cookie jar)"
    if name.startswith("policy/"):
        return name
    if name.startswith("gateway/"):
        return "gateway/*"
    if name == "stdlib:<string>":
        return "stdlib: dataclasses' generated methods"
    return name if name.startswith("site:") else "stdlib: the rest"


async def count(requests: int) -> dict[str, Counter[str]]:
    bench = setup("auto", stand_in_engine=True)
    counts: dict[str, Counter[str]] = {}
    try:
        for name in ("off", "on"):
            app = bench.apps[name]
            by_file: Counter[str] = Counter()

            def local(frame: FrameType, event: str, arg: Any) -> Any:
                if event == "opcode":
                    by_file[frame.f_code.co_filename] += 1
                return local

            def tracer(frame: FrameType, event: str, arg: Any) -> Any:
                frame.f_trace_opcodes = True
                return local

            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://opcodes", timeout=60) as client:
                    for _ in range(30):
                        await client.post("/v1/completions", json=body_for(bench.headers[name]),
                                          headers=bench.headers[name])  # fmt: skip
                    sys.settrace(tracer)
                    try:
                        for _ in range(requests):
                            response = await client.post("/v1/completions", json=body_for(bench.headers[name]),
                                                         headers=bench.headers[name])  # fmt: skip
                    finally:
                        sys.settrace(None)
                    if response.status_code != 200:
                        raise SystemExit(f"unexpected {response.status_code}: {response.text}")
            counts[name] = Counter()
            for filename, n in by_file.items():
                counts[name][place(filename)] += n // requests
    finally:
        bench.close()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20, help="requests counted per variant")
    args = parser.parse_args()
    print(__doc__.split("Usage:")[0].strip(), end="\n\n")
    counts = asyncio.run(count(args.requests))
    off, on = counts["off"], counts["on"]
    print(f"bytecodes per request: off {sum(off.values()):,}, on {sum(on.values()):,}, "
          f"added by the chain {sum(on.values()) - sum(off.values()):+,}\n")  # fmt: skip
    added: Counter[str] = Counter()
    for name in on.keys() | off.keys():
        added[group(name)] += on[name] - off[name]
    print("| where | added bytecodes per request |\n|---|---|")
    for where, n in sorted(added.items(), key=lambda item: -item[1]):
        if n:
            print(f"| {where} | {n:+,} |")


if __name__ == "__main__":
    main()
