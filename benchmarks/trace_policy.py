#!/usr/bin/env python3
"""Where a served request's time goes, stage by stage, with the policy chain off and on.

Method
------
The apps of ``bench_policy.py`` (same model, store, policies and request:
``off`` and ``on``), driven in-process, one request at a time, alternating.
Wrappers around the gateway's own steps (``gateway.pipeline.policy``'s input
guardrails, rate-limit reservation and OPA decision; ``gateway.pipeline.plan``'s
tokenising and planning; the route's collection;
the audit middleware's event building and durable wait; the spool's write and
its syncer's fsync; the engine's ``stream``) stamp ``time.perf_counter()``
the first time each step is reached. Per request, the stamps are sorted and
each gap between consecutive ones is a segment; the report is each segment's
median over the requests, for both variants. The wrappers cost a few
microseconds each, the same in both variants.

Last, a probe times an fsync of one appended line in a plain loop: back to
back, and with a 30 ms pause before each (about one generation step, as when
a single client waits for each answer): on some virtual disks an fsync after
an idle spell costs several times more, which puts a floor under a durable
audit event's latency at low load.

``--fine`` also stamps the steps inside the stages (authentication, the input
check, the limiter's parts, the output checker, the audit event's digests,
JSON and seal). ``--stand-in-engine`` answers at once instead of generating
(``bench_policy.py``'s stand-in), and ``--gap-ms N`` spins N ms before each
request, untimed: together, the gateway's own steps as cold as a request finds
them after a generation, without the generation's noise.

Usage:
    .venv/bin/python benchmarks/trace_policy.py [--requests 200] [--dtype auto] [--fine] [--stand-in-engine] [--gap-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from bench_policy import body_for, setup  # noqa: E402  (this folder is on sys.path)
from policy_paired import spin  # noqa: E402

import inferflux.gateway.audit as gateway_audit  # noqa: E402
import inferflux.gateway.pipeline.render as pipeline_render  # noqa: E402
import inferflux.gateway.pipeline.run as pipeline_run  # noqa: E402
from inferflux.gateway.pipeline.policy import RequestPolicy  # noqa: E402
import inferflux.policy.audit.spool as spool_module  # noqa: E402

_stamps: dict[str, float] = {}


def stamp(name: str) -> None:
    _stamps.setdefault(name, time.perf_counter())


def around(owner: Any, name: str, before: str | None, after: str | None) -> None:
    """Stamp ``before`` and ``after`` a call of ``owner.name`` (sync or async)."""
    inner = getattr(owner, name)
    if asyncio.iscoroutinefunction(inner):

        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            if before:
                stamp(before)
            result = await inner(*args, **kwargs)
            if after:
                stamp(after)
            return result

        setattr(owner, name, wrapped_async)
        return

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            stamp(before)
        result = inner(*args, **kwargs)
        if after:
            stamp(after)
        return result

    setattr(owner, name, wrapped)


class Planned:
    """A planner's holder, so that ``around`` can wrap it like a module's function."""

    def __init__(self, plan: Callable[..., Any]) -> None:
        self.plan = plan


def instrument(engine: Any) -> None:
    around(RequestPolicy, "screen", "handler", "input guardrails")
    around(RequestPolicy, "place", None, "placed")
    planned = Planned(pipeline_run.COMPLETION.plan)  # the driver finds its planner in COMPLETION, looked up per call
    around(planned, "plan", None, "planned")
    pipeline_run.COMPLETION = dataclasses.replace(pipeline_run.COMPLETION, plan=planned.plan)
    around(RequestPolicy, "_reserve", None, "limits reserved")
    around(RequestPolicy, "_opa_document", "OPA: document", None)
    around(RequestPolicy, "_refuse_if_denied", None, "OPA allowed")
    around(pipeline_render, "collect", None, "collected")
    around(gateway_audit, "build_event", "audit: build", "audit: built")
    around(gateway_audit.AuditMiddleware, "_record", None, "audit: durable")
    around(spool_module, "write_all", "audit: write", "audit: written")
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        syncer = threading.current_thread().name == "audit-spool-syncer"
        if syncer:
            stamp("audit: fsync")
        real_fsync(fd)
        if syncer:
            stamp("audit: fsynced")

    os.fsync = fsync  # type: ignore[assignment]
    stream = engine.stream

    async def timed(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        stamp("engine: called")
        async for output in stream(*args, **kwargs):
            stamp("engine: first output")
            yield output
        stamp("engine: done")

    engine.stream = timed


def instrument_finely() -> None:
    """``--fine``: also the steps inside the stages (authentication, the input check, the limiter's
    parts, the output checker, the audit event's digests, JSON and seal), to tell which part of a
    stage its in-request cost is."""
    import inferflux.gateway.auth as gateway_auth
    import inferflux.policy.audit.events as audit_events
    import inferflux.policy.guardrails.engine as guardrails_engine
    import inferflux.policy.guardrails.screen as guardrails_screen
    import inferflux.policy.guardrails.stream as guardrails_stream
    import inferflux.policy.ratelimit.limiter as limiter
    import inferflux.policy.ratelimit.memory as memory

    around(gateway_auth.Authenticator, "authenticate", "auth", "authed")
    around(guardrails_screen, "collect", None, "g.texts")  # the body's texts, gathered for the input check
    around(guardrails_engine.Guardrails, "check_input", None, "g.checked")
    around(limiter.RateLimiter, "check_and_reserve", "rl.start", "rl.done")
    around(memory.MemoryBackend, "reserve", "rl.backend", "rl.backend.done")
    around(guardrails_stream.OutputStream, "feed", "out.feed", "out.fed")
    around(RequestPolicy, "finish", "finish", "finished")
    around(audit_events.ContentDigester, "digest", "ev.digest", None)
    around(audit_events.AuditEvent, "to_json", "ev.to_json", "ev.json")
    around(spool_module, "sealed_line", None, "ev.sealed")


def fsync_probe(pause: float, n: int = 60) -> float:
    """Median ms of an fsync after appending one line, with ``pause`` seconds before each."""
    with tempfile.TemporaryDirectory() as scratch:
        fd = os.open(Path(scratch) / "probe", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        times = []
        for _ in range(n):
            time.sleep(pause)
            os.write(fd, b"x" * 850 + b"\n")
            start = time.perf_counter()
            os.fsync(fd)
            times.append(time.perf_counter() - start)
        os.close(fd)
    return statistics.median(times) * 1000


async def trace(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    bench = setup(args.dtype, stand_in_engine=args.stand_in_engine)
    instrument(bench.served.engine)
    if args.fine:
        instrument_finely()
    names = ("off", "on")
    segments: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in names}
    async with contextlib.AsyncExitStack() as stack:
        for name in names:
            app = bench.apps[name]
            await stack.enter_async_context(app.router.lifespan_context(app))
        clients = {
            name: httpx.AsyncClient(transport=httpx.ASGITransport(app=bench.apps[name]), base_url="http://trace",
                                    timeout=60)  # fmt: skip
            for name in names
        }
        for i in range(20 + args.requests):  # the first 20 warm up
            for name in names:
                if args.gap_ms:
                    spin(args.gap_ms / 1000)
                _stamps.clear()
                _stamps["sent"] = time.perf_counter()
                response = await clients[name].post("/v1/completions", json=body_for(bench.headers[name]),
                                                    headers=bench.headers[name])  # fmt: skip
                _stamps["answered"] = time.perf_counter()
                if response.status_code != 200:
                    raise SystemExit(f"unexpected {response.status_code}: {response.text}")
                if i < 20:
                    continue
                order = sorted(_stamps.items(), key=lambda item: item[1])
                for (a, at), (b, bt) in zip(order, order[1:]):
                    segments[name][f"{a} -> {b}"].append((bt - at) * 1000)
                segments[name]["TOTAL"].append((_stamps["answered"] - _stamps["sent"]) * 1000)
        for client in clients.values():
            await client.aclose()
    bench.close()
    # A segment seen in most requests (a stamp can land out of order in a few).
    return {
        name: {seg: statistics.median(v) for seg, v in found.items() if len(v) >= args.requests * 0.8}
        for name, found in segments.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("Method")[0].strip())
    parser.add_argument("--requests", type=int, default=200, help="requests per variant")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--fine", action="store_true", help="also stamp the steps inside each stage")
    parser.add_argument("--stand-in-engine", action="store_true",
                        help="answer at once instead of generating (bench_policy.py's stand-in)")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="before each request, spin this long (untimed): a pause without a forward")
    args = parser.parse_args()
    report = asyncio.run(trace(args))
    print(__doc__.split("Usage:")[0].strip())
    print(f"\n{args.requests} requests per variant, one at a time; median ms of each segment")
    for name, found in report.items():
        print(f"\n| {name}: segment | p50 ms |\n|---|---|")
        for segment, ms in found.items():
            print(f"| {segment} | {ms:.3f} |")
    probes: dict[str, Callable[[], float]] = {
        "back to back": lambda: fsync_probe(0.0),
        "after 30 ms idle": lambda: fsync_probe(0.03),
    }
    print("\n| fsync of one appended line | p50 ms |\n|---|---|")
    for label, probe in probes.items():
        print(f"| {label} | {probe():.3f} |")


if __name__ == "__main__":
    main()
