#!/usr/bin/env python3
"""Prefix-aware routing against the fleet's non-affine policy, with InferFlux engines as upstreams.

Method
------
Three processes on loopback, started by this script (``inferctl serve``, each
with its own data directory and SQLite store):

* two InferFlux engines serving the default model (SmolLM2 on the CPU backend,
  prefix caching on as by default), the upstream fleet, both with the same
  bootstrap admin key: the gateway's one upstream key, so the engines see every
  request as one tenant and share one prefix-cache namespace. Each engine runs
  ``--engine-threads`` threads (``OMP_NUM_THREADS``, default 1: a core each, as
  two machines would have, instead of both pools fighting over both cores);
* one InferFlux gateway that serves no model itself and fronts both engines
  with two models of backend ``openai`` over the same two endpoints:
  ``fleet-prefix`` (``routing: prefix``: a consistent-hash ring with bounded
  load over the affinity key, tenant + the first 2,048 characters of the
  prompt) and ``fleet-lo`` (``routing: least_outstanding``: the fewest requests
  in flight, ties taken in turn round the fleet; the fleet has no plain
  round-robin, and this is its non-affine policy). Active health checks are
  off (``health_interval_seconds: 0``) so that a check slowed past its timeout
  on the loaded machine cannot take an endpoint out of either policy's choice;
  a failed request would still count, and the failures are reported.

Workload: ``--tenants`` tenants, each with its own member key on the gateway
and its own system prompt (generated from a seed, ``--system-chars``
characters: a few hundred tokens, and longer than the affinity key reads, so
that the key is the tenant's alone). Each tenant sends ``--requests``
streaming chat completions, its system prompt then a short question of its
own, ``max_tokens`` ``--max-tokens``, greedy, so prefill dominates. The
requests of all tenants are shuffled with ``--seed`` into one sequence and
sent by ``--concurrency`` workers in that order; the same sequence is sent in
every pass.

A pass is one policy over cold engines: both engines are (re)started, so their
prefix caches are empty, each gets one short unrelated warm-up request
directly (the first forward's own costs), then the workload goes through the
gateway. The passes alternate ``prefix, lo`` then ``lo, prefix`` for
``--reps`` repetitions. The gateway runs for the whole benchmark (the same
tenants, so the same affinity keys and ring placement in every pass).

Measured per pass: the engines' prefix-cache hit rate (prompt tokens the cache
supplied / prompt tokens looked up, the ``inferflux_prefix_cache_*`` counters
of both engines' ``/metrics``, after the warm-up to the end, summed over the
two), time to first token through the gateway (send -> the first chunk with
content) p50 and p90, and the pass's wall time (first send to last byte), with
how many requests each endpoint got (the gateway's ``GET
/admin/v1/models/{name}``) and each engine's KV blocks. Per policy: medians over its passes. The CPU model
comes from ``lscpu``; the load average is recorded at the start, before and
after every pass. ``--wait-load L`` first waits (checking every minute, for up
to ``--wait-minutes``) until the 1-minute load average is at most L, and runs
anyway when it is not.

``--kv-cache-bytes`` sizes each engine's KV cache: the default (the engine's
own) holds every tenant's prefix on each engine, so the non-affine policy loses
only one cold prefill per tenant and engine; a cache that holds about half
of them is the case of a fleet whose prompts outnumber one cache.

Usage:
    .venv/bin/python benchmarks/bench_prefix_routing.py [--tenants 8] [--requests 12] [--concurrency 6]
        [--reps 2] [--kv-cache-bytes 160MiB] [--wait-load 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench_auth import pct  # (this folder is on sys.path)
from bench_fairness import REPO_ROOT, Server, cpu_model, free_port, new_admin_key
from bench_upstream import loadavg
from bench_upstream import wait_for_quiet as wait_for_load

MODEL = "smollm2-135m-instruct"  # what the engines serve (gateway.settings.DEFAULT_MODEL_NAME)
UPSTREAM_KEY_ENV = "INFERFLUX_UPSTREAM_BENCH_KEY"  # under upstreams.api_key_env_prefix
POLICIES = {"prefix": "fleet-prefix", "lo": "fleet-lo"}
ROUTING = {"prefix": "prefix", "lo": "least_outstanding"}
AFFINITY_CHARS = 2048  # gateway.pipeline.plan_remote.AFFINITY_CHARS (not imported: the gateway is another process)
_METRIC_NAMES = {"inferflux_prefix_cache_queried_tokens": "queried", "inferflux_prefix_cache_hit_tokens": "hit",
                 "inferflux_kv_blocks_used": "blocks", "inferflux_kv_blocks_free": "blocks"}
_METRIC = re.compile(rf"^({'|'.join(_METRIC_NAMES)})(?:_total)?(?:\{{[^}}]*\}})?\s+(\S+)$")

# The system prompts' material: a made-up company's house rules, different for each tenant.
_NAMES = ["Aldermoor", "Brightwater", "Cobalt Reach", "Dunmore", "Elmsworth", "Fairhaven", "Greystone", "Highfield",
          "Ironbridge", "Juniper Vale", "Kestrel Point", "Larchmont", "Millbrook", "Northgate", "Oakhurst", "Pinecrest"]
_SUBJECTS = ["a member", "a guest", "the duty manager", "a volunteer", "a contractor", "the night porter",
             "a student", "a supplier", "the treasurer", "a visiting lecturer"]
_VERBS = ["must sign for", "may borrow", "should inspect", "must never remove", "may reserve", "has to return",
          "can request", "must report damage to", "may photograph", "should label"]
_OBJECTS = ["the projector", "the archive boxes", "the meeting room keys", "the rowing boats", "the sound desk",
            "the first-aid kit", "the loan laptops", "the garden tools", "the darkroom", "the printed minutes"]
_WHEN = ["before nine in the morning", "on public holidays", "during the spring audit", "after the last bell",
         "while the lift is out of order", "on the first Monday of the month", "when the car park is full",
         "for events of more than forty people", "within two working days", "unless the board agrees otherwise"]
_TOPICS = ["late returns", "lost keys", "weekend access", "guest passes", "damaged equipment", "room bookings",
           "fees", "deliveries", "noise", "parking"]
Sequence = list[tuple[int, list[dict[str, str]]]]  # the requests in order: (tenant, chat messages)


def system_prompt(tenant: int, chars: int, seed: int) -> str:
    """Tenant ``tenant``'s system prompt: numbered house rules until it is ``chars`` characters long."""
    rng = random.Random(seed * 1000 + tenant)
    name = f"{_NAMES[tenant % len(_NAMES)]} {tenant}"
    parts = [f"You are the help desk of the {name} community centre. Answer in one short sentence, "
             f"citing the rule you rely on. The house rules of {name}:"]  # fmt: skip
    rule = 1
    while sum(len(p) + 1 for p in parts) < chars:
        parts.append(f"Rule {rule}: {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                     f"{rng.choice(_WHEN)}, and {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                     f"{rng.choice(_WHEN)}.")  # fmt: skip
        rule += 1
    return " ".join(parts)[:chars]


def workload(args: argparse.Namespace) -> Sequence:
    """The request sequence, the same for every pass: (tenant, messages), shuffled with the seed."""
    rng = random.Random(args.seed)
    systems = [system_prompt(t, args.system_chars, args.seed) for t in range(args.tenants)]
    sequence = []
    for tenant in range(args.tenants):
        for i in range(args.requests):
            question = f"Question {i} from visitor {rng.randrange(10_000)}: what do the rules say about " \
                       f"{rng.choice(_TOPICS)}?"  # fmt: skip
            sequence.append((tenant, [{"role": "system", "content": systems[tenant]},
                                      {"role": "user", "content": question}]))  # fmt: skip
    rng.shuffle(sequence)
    return sequence


def engine_counters(url: str) -> dict[str, float]:
    """From the engine's /metrics: prompt tokens looked up in and supplied by the prefix cache, and KV blocks."""
    text = httpx.get(url + "/metrics", timeout=30).text
    found = {"queried": 0.0, "hit": 0.0, "blocks": 0.0}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match:
            found[_METRIC_NAMES[match.group(1)]] += float(match.group(2))
    return found


class Bench:
    """The three processes: two engines (restarted for every pass) and the gateway (for the whole run)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.python = sys.executable
        self.fleet_key = new_admin_key(self.python, REPO_ROOT)  # both engines' admin key: the gateway's upstream key
        self.engine_ports = [free_port(), free_port()]
        self.engine_args = ["--kv-cache-bytes", args.kv_cache_bytes] if args.kv_cache_bytes else []
        self.engines: list[Server] = []
        self.config_dir = Path(tempfile.mkdtemp(prefix="bench-prefix-routing-"))
        upstream = {"endpoints": [f"http://127.0.0.1:{port}/v1" for port in self.engine_ports], "model": MODEL,
                    "api_key_env": UPSTREAM_KEY_ENV, "health_interval_seconds": 0, "timeout_seconds": 900,
                    "idle_timeout_seconds": 600}  # fmt: skip
        # The engines are on loopback: a private address, which the gateway reaches only where it is allowed.
        config = {"models": [{"name": name, "backend": "openai", "upstream": {**upstream, "routing": ROUTING[policy]}}
                             for policy, name in POLICIES.items()], "upstreams": {"allowed_hosts": ["127.0.0.1"]}}  # fmt: skip
        config_file = self.config_dir / "gateway.yaml"
        config_file.write_text(json.dumps(config, indent=2))  # JSON is YAML
        self.gateway = Server(REPO_ROOT, self.python, ["--config", str(config_file)],
                              env={UPSTREAM_KEY_ENV: self.fleet_key})  # fmt: skip
        self.keys: list[str] = []

    def start(self) -> None:
        self.restart_engines()
        self.gateway.wait_ready()
        self.keys = [self.gateway.member_key(f"tenant-{t}") for t in range(self.args.tenants)]

    def restart_engines(self) -> None:
        """Stop the engines (if running) and start them afresh on the same ports: empty prefix caches."""
        for engine in self.engines:
            engine.stop()
            shutil.rmtree(engine.data, ignore_errors=True)
        threads = {"OMP_NUM_THREADS": str(self.args.engine_threads)}  # torch's and the C++ kernels' thread pools
        self.engines = [Server(REPO_ROOT, self.python, self.engine_args, port=port, admin_key=self.fleet_key,
                               env=threads) for port in self.engine_ports]  # fmt: skip
        for engine in self.engines:
            try:
                engine.wait_ready()
            except SystemExit:
                print(Path(engine.log.name).read_text(errors="replace")[-3000:], file=sys.stderr)
                raise
        for engine in self.engines:  # the first forward's own costs, outside the measurement
            answer = httpx.post(engine.url + "/v1/chat/completions", timeout=600,
                                headers={"authorization": f"Bearer {self.fleet_key}"},
                                json={"model": MODEL, "max_tokens": 2, "temperature": 0,
                                      "messages": [{"role": "user", "content": "Hello"}]})  # fmt: skip
            answer.raise_for_status()

    def endpoints(self, model: str) -> list[dict[str, Any]]:
        """The gateway's view of ``model``'s endpoints: requests sent, failures, circuit."""
        answer = httpx.get(self.gateway.url + f"/admin/v1/models/{model}", timeout=30,
                           headers={"authorization": f"Bearer {self.gateway.admin_key}"})  # fmt: skip
        answer.raise_for_status()
        return list(answer.json()["upstream"]["endpoints"])

    def stop(self) -> None:
        for server in [*self.engines, self.gateway]:
            server.stop()
            shutil.rmtree(server.data, ignore_errors=True)
        shutil.rmtree(self.config_dir, ignore_errors=True)


async def one_request(client: httpx.AsyncClient, model: str, key: str, messages: list[dict[str, str]],
                      max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """One streamed chat completion through the gateway: its TTFT, latency and prompt tokens."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first: float | None = None
    prompt_tokens = None
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as response:  # fmt: skip
        if response.status_code != 200:
            raise SystemExit(f"unexpected {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    if first is None:
        raise SystemExit("a stream ended without content")
    return {"ttft_s": first, "latency_s": time.perf_counter() - start, "prompt_tokens": prompt_tokens}


async def send_all(bench: Bench, model: str, sequence: Sequence) -> tuple[list[dict[str, Any]], float]:
    """The sequence through the gateway, ``--concurrency`` at a time in order; the results and the wall time."""
    args = bench.args
    queue: asyncio.Queue[tuple[int, list[dict[str, str]]]] = asyncio.Queue()
    for item in sequence:
        queue.put_nowait(item)
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=bench.gateway.url, timeout=900, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                tenant, messages = queue.get_nowait()
                result = await one_request(client, model, bench.keys[tenant], messages, args.max_tokens)
                results.append({"tenant": tenant, **result})

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return results, time.perf_counter() - start


def run_pass(bench: Bench, policy: str, sequence: Sequence, fresh: bool) -> dict[str, Any]:
    """One policy over cold engines: restart them (unless just started), then the whole sequence."""
    model = POLICIES[policy]
    if not fresh:
        bench.restart_engines()
    load_before = loadavg()
    before = [engine_counters(engine.url) for engine in bench.engines]
    sent_before = bench.endpoints(model)
    results, wall = asyncio.run(send_all(bench, model, sequence))
    after = [engine_counters(engine.url) for engine in bench.engines]
    sent_after = bench.endpoints(model)
    queried = [a["queried"] - b["queried"] for a, b in zip(after, before, strict=True)]
    hit = [a["hit"] - b["hit"] for a, b in zip(after, before, strict=True)]
    ttfts = [r["ttft_s"] for r in results]
    return {
        "policy": policy, "model": model, "routing": ROUTING[policy],
        "load_average_before": load_before, "load_average_after": loadavg(),
        "requests": len(results), "wall_s": wall, "kv_blocks_per_engine": [b["blocks"] for b in before],
        "hit_rate": sum(hit) / sum(queried) if sum(queried) else 0.0,
        "queried_tokens": queried, "hit_tokens": hit,
        "per_engine_hit_rate": [h / q if q else 0.0 for h, q in zip(hit, queried, strict=True)],
        "requests_per_endpoint": [a["requests"] - b["requests"] for a, b in zip(sent_after, sent_before, strict=True)],
        "failures_per_endpoint": [a["failures"] - b["failures"] for a, b in zip(sent_after, sent_before, strict=True)],
        "ttft_p50_ms": statistics.median(ttfts) * 1000, "ttft_p90_ms": pct(ttfts, 90) * 1000,
        "latency_p50_ms": statistics.median(r["latency_s"] for r in results) * 1000,
        "prompt_tokens": sorted({r["prompt_tokens"] for r in results if r["prompt_tokens"] is not None}),
        "ttft_ms": [round(t * 1000, 1) for t in ttfts],
    }


def summary(passes: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per policy, the median of each figure over its passes."""
    out = {}
    for policy in POLICIES:
        mine = [p for p in passes if p["policy"] == policy]
        if mine:
            out[policy] = {name: statistics.median(p[name] for p in mine)
                           for name in ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "wall_s")}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("Method")[0].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--requests", type=int, default=12, help="requests per tenant")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--system-chars", type=int, default=2400,
                        help=f"length of each tenant's system prompt (over {AFFINITY_CHARS} for a per-tenant key)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of (prefix, lo), the order flipped each time")
    parser.add_argument("--kv-cache-bytes", help="each engine's KV cache, e.g. 160MiB (default: the engine's)")
    parser.add_argument("--engine-threads", type=int, default=1, help="OMP_NUM_THREADS of each engine")
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--wait-load", type=float, help="first wait until the 1-minute load average is at most this")
    parser.add_argument("--wait-minutes", type=float, default=20.0)
    parser.add_argument("--json", type=Path, help="write the results here (rewritten after every pass)")
    args = parser.parse_args()

    print(__doc__.split("Usage:")[0].strip(), flush=True)
    waited = wait_for_load(args.wait_load, args.wait_minutes) if args.wait_load is not None else [loadavg()]
    sequence = workload(args)
    order = [p for rep in range(args.reps) for p in (("prefix", "lo") if rep % 2 == 0 else ("lo", "prefix"))]
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(), "cpus": os.cpu_count(), "load_average_waited": waited,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "order": order, "passes": [], "complete": False,
    }
    print(f"\ncpu: {report['cpu']} ({report['cpus']} logical CPUs); load average {waited[-1]}", flush=True)
    bench = Bench(args)
    try:
        bench.start()
        for i, policy in enumerate(order):
            result = run_pass(bench, policy, sequence, fresh=i == 0)
            report["passes"].append(result)
            print(f"pass {i + 1}/{len(order)} {policy:>6}: hit rate {result['hit_rate']:.3f} "
                  f"(engines {[round(x, 3) for x in result['per_engine_hit_rate']]}), "
                  f"TTFT p50 {result['ttft_p50_ms']:.0f} ms p90 {result['ttft_p90_ms']:.0f} ms, "
                  f"wall {result['wall_s']:.1f} s, requests per endpoint {result['requests_per_endpoint']}, "
                  f"failures {result['failures_per_endpoint']}, load {result['load_average_before']} -> "
                  f"{result['load_average_after']}", flush=True)  # fmt: skip
            report["summary"] = summary(report["passes"])
            if args.json:
                args.json.write_text(json.dumps(report, indent=2))
    finally:
        bench.stop()
    report["complete"] = True
    report["load_average_end"] = loadavg()
    print(f"\n{args.tenants} tenants x {args.requests} requests, concurrency {args.concurrency}, "
          f"max_tokens {args.max_tokens}, prompt tokens {report['passes'][0]['prompt_tokens'][:1]}.., "
          f"KV cache per engine: {args.kv_cache_bytes or 'the default'}; medians over passes")  # fmt: skip
    print("| routing | prefix-cache hit rate | TTFT p50 ms | TTFT p90 ms | wall s |")
    print("|---|---|---|---|---|")
    for policy, row in report["summary"].items():
        print(f"| {ROUTING[policy]} | {row['hit_rate']:.3f} | {row['ttft_p50_ms']:.0f} | {row['ttft_p90_ms']:.0f} | "
              f"{row['wall_s']:.1f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
