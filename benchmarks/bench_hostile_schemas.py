#!/usr/bin/env python3
"""Hostile schemas and tool lists against a served gateway: does a trivial request stay fast, memory flat?

Method
------
A real gateway (``inferctl serve``, default settings: the grammar budget is 1 s of CPU and
5 s of wall time for a request's new grammars, two grammar workers, a 30 s wait for one;
the bundled SmolLM2 on the CPU backend) on a loopback port. A tenant with an input
guardrail (a word list) and a member key of it, made over the admin API.

1. Idle: ``--trivial`` trivial requests one after another (``GET /v1/models`` with the
   member's key: authentication, the audit trail and the event loop, no engine), after
   ``--warmup`` of them; their latencies give the idle p50/p99.
2. Under attack: the same trivial loop runs while ``--rounds`` rounds of 8 hostile
   ``response_format`` schemas and 8 hostile tool lists are sent at once (16 concurrent
   requests a round), each to ``/v1/chat/completions``. The hostile bodies are of two
   kinds: over a size limit (an ``allOf`` of 420 ``pattern``s, an enum of 5,000 values
   holding the guardrail's word, nesting 27 deep, a ``minLength`` of 10^9, 200 tools),
   refused before the guardrail, and under the size limits but expensive to compile (a
   string with an ``allOf`` of 20 to 26 patterns: seconds to minutes of llguidance time
   each, gigabytes for the larger), refused by the grammar budget. Every hostile body of
   a round is its own (fresh letters in its patterns), so no verdict is remembered.
   The loop ends when every hostile request has been answered.

Reported: the trivial request's p50/p99 idle and under attack, and their ratio (target
p99 ≤ 2× idle); the gateway process's resident memory before, at its peak during and
after the attack (target growth ≤ 100 MiB; sampled from /proc every 50 ms; the grammar
workers are separate processes, reported apart); each hostile request's status, code and
time (target: every one a 400 within the budget's bound: the wait for a worker, the wall
time, and a few seconds for the rest). The CPU model comes from ``lscpu``. A JSON copy
goes to ``benchmarks/results/`` (``--json`` elsewhere).

Usage:
    .venv/bin/python benchmarks/bench_hostile_schemas.py [--trivial 400] [--rounds 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its neighbours, also under python -P
from bench_auth import pct, timed_requests  # noqa: E402
from bench_fairness import Server, cpu_model  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
BLOCKED = "zzqword"
BUDGET_BOUND = 30.0 + 5.0 + 10.0  # grammar.queue_seconds + grammar.wall_seconds (defaults) + the rest of a request


def resident(pid: int) -> int:
    """Resident bytes of ``pid`` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def children(pid: int) -> set[int]:
    """The child processes of ``pid`` (the grammar workers), whichever of its threads started them (each
    thread's list may repeat another's)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    return found


def guarded_member(server: Server) -> str:
    """A member key of a new tenant whose input guardrail blocks ``BLOCKED``."""
    admin = {"authorization": f"Bearer {server.admin_key}"}
    tenant = httpx.post(server.url + "/admin/v1/tenants", json={"name": "hostile"}, headers=admin, timeout=30)
    tenant.raise_for_status()
    tenant_id = tenant.json()["id"]
    guardrail = httpx.post(server.url + "/admin/v1/guardrails", headers=admin, timeout=30, json={
        "tenant_id": tenant_id, "name": "words", "spec": {"blocklist": [{"id": "w", "literal": BLOCKED}]}})
    guardrail.raise_for_status()
    key = httpx.post(server.url + f"/admin/v1/tenants/{tenant_id}/keys", json={"name": "bench", "role": "member"},
                     headers=admin, timeout=30)  # fmt: skip
    key.raise_for_status()
    return str(key.json()["key"])


# -- the hostile bodies ---------------------------------------------------------------------


def patterns(tag: str, count: int) -> dict[str, Any]:
    return {"type": "object", "required": ["s"], "properties": {"s": {
        "type": "string", "allOf": [{"pattern": f"{tag}{i:04d}[a-z]+{tag}{i:04d}"} for i in range(count)]}}}  # fmt: skip


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"p{i}": schema}}
    return schema


def hostile_schemas(tag: str) -> list[tuple[str, dict[str, Any]]]:
    """Eight (name, schema): four over a size limit, four under them but over the compile budget."""
    enum = [f"value {i}" for i in range(4999)] + [BLOCKED]
    return [
        ("allOf of 420 patterns (14 KB)", patterns(f"{tag}a", 420)),
        ("enum of 5,000 values", {"type": "object", "properties": {"v": {"enum": enum}}}),
        ("nested 27 deep", nested(13)),  # two JSON levels a schema level, and the leaf
        ("minLength 10^9", {"type": "object", "properties": {"v": {"type": "string", "minLength": 10**9}}}),
        *[(f"allOf of {n} patterns", patterns(f"{tag}{letter}", n)) for n, letter in
          ((20, "b"), (22, "c"), (24, "d"), (26, "e"))],
    ]  # fmt: skip


def hostile_bodies(tag: str) -> list[tuple[str, dict[str, Any]]]:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    bodies = []
    for name, schema in hostile_schemas(f"{tag}r"):
        bodies.append((f"response_format: {name}", {**base, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}))  # fmt: skip
    for name, schema in hostile_schemas(f"{tag}t")[1:]:
        tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
                 for i in range(3)] + [{"type": "function", "function": {"name": "hostile", "parameters": schema}}]
        bodies.append((f"tools: {name}", {**base, "tools": tools}))
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(200)]
    bodies.append(("tools: 200 tools", {**base, "tools": many}))
    return bodies


# -- the loops ---------------------------------------------------------------------------------


async def trivial_until(client: httpx.AsyncClient, headers: dict[str, str], stop: asyncio.Event) -> list[float]:
    """Trivial requests one after another (``bench_auth.timed_requests``'s, in rounds of ten) until ``stop``."""
    latencies: list[float] = []
    while not stop.is_set():
        latencies += await timed_requests(client, headers, 10)
    return latencies


async def hostile(client: httpx.AsyncClient, key: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    answer = await client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
    took = time.perf_counter() - start
    error = answer.json().get("error", {}) if answer.headers.get("content-type", "").startswith("application/json") else {}
    return {"name": name, "status": answer.status_code, "code": error.get("code"), "param": error.get("param"),
            "seconds": round(took, 3), "message": (error.get("message") or "")[:200]}  # fmt: skip


async def sample_memory(pid: int, stop: asyncio.Event, peaks: dict[str, int]) -> None:
    while not stop.is_set():
        peaks["gateway"] = max(peaks["gateway"], resident(pid))
        peaks["workers"] = max(peaks["workers"], sum(resident(c) for c in children(pid)))
        await asyncio.sleep(0.05)


async def run(server: Server, key: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
        headers = {"authorization": f"Bearer {key}"}
        await timed_requests(client, headers, args.warmup)
        idle = await timed_requests(client, headers, args.trivial)
        before = resident(server.proc.pid)
        stop = asyncio.Event()
        peaks = {"gateway": before, "workers": 0}
        sampler = asyncio.create_task(sample_memory(server.proc.pid, stop, peaks))
        loop = asyncio.create_task(trivial_until(client, headers, stop))
        results: list[dict[str, Any]] = []
        started = time.perf_counter()
        for round_ in range(args.rounds):
            bodies = hostile_bodies(f"r{round_}x")
            results += await asyncio.gather(*(hostile(client, key, name, body) for name, body in bodies))
        attack_seconds = time.perf_counter() - started
        stop.set()
        attacked = await loop
        await sampler
        await asyncio.sleep(1.0)
        after = resident(server.proc.pid)
    return {"idle": idle, "attacked": attacked, "hostile": results, "attack_seconds": attack_seconds,
            "memory": {"before": before, "peak": peaks["gateway"], "after": after, "workers_peak": peaks["workers"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--trivial", type=int, default=400, help="idle trivial requests (default 400)")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of 16 hostile requests (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="where to write the results "
                        "(default: benchmarks/results/hostile-schemas-<date>.json)")  # fmt: skip
    args = parser.parse_args()

    server = Server(REPO_ROOT, sys.executable, [])
    try:
        server.wait_ready()
        key = guarded_member(server)
        measured = asyncio.run(run(server, key, args))
    finally:
        server.stop()

    idle, attacked = measured["idle"], measured["attacked"]
    ms = lambda v: round(v * 1000, 2)  # noqa: E731
    memory = measured["memory"]
    mib = 1 << 20
    hostile = measured["hostile"]
    within = [h for h in hostile if h["status"] == 400 and h["seconds"] <= BUDGET_BOUND]
    result = {
        "benchmark": "bench_hostile_schemas",
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "trivial_request": "GET /v1/models with a member key",
        "idle": {"requests": len(idle), "p50_ms": ms(statistics.median(idle)), "p99_ms": ms(pct(idle, 99))},
        "attacked": {"requests": len(attacked), "p50_ms": ms(statistics.median(attacked)),
                     "p99_ms": ms(pct(attacked, 99)), "seconds": round(measured["attack_seconds"], 2)},
        "p99_ratio": round(pct(attacked, 99) / pct(idle, 99), 2),
        "gateway_resident_mib": {k: round(memory[k] / mib, 1) for k in ("before", "peak", "after")},
        "gateway_growth_mib": round((memory["peak"] - memory["before"]) / mib, 1),
        "grammar_workers_peak_mib": round(memory["workers_peak"] / mib, 1),
        "hostile_requests": len(hostile),
        "hostile_400_within_bound": len(within),
        "hostile_bound_seconds": BUDGET_BOUND,
        "hostile": hostile,
    }  # fmt: skip
    print(f"CPU: {result['cpu']} ({result['cores']} cores)")
    print(f"trivial request ({result['trivial_request']}): idle p50 {result['idle']['p50_ms']} ms, "
          f"p99 {result['idle']['p99_ms']} ms ({len(idle)} requests)")
    print(f"  under attack: p50 {result['attacked']['p50_ms']} ms, p99 {result['attacked']['p99_ms']} ms "
          f"({len(attacked)} requests over {result['attacked']['seconds']} s); p99 ratio {result['p99_ratio']} "
          f"(target <= 2)")
    print(f"gateway resident memory: {result['gateway_resident_mib']} MiB, growth at peak "
          f"{result['gateway_growth_mib']} MiB (target <= 100); grammar workers' peak "
          f"{result['grammar_workers_peak_mib']} MiB")
    for h in hostile:
        print(f"  {h['status']} {h['code'] or '-':<20} {h['seconds']:7.2f} s  {h['name']}")
    print(f"hostile requests answered 400 within {BUDGET_BOUND:g} s: {len(within)} of {len(hostile)}")
    path = args.json or REPO_ROOT / "benchmarks" / "results" / f"hostile-schemas-{result['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
