#!/usr/bin/env python3
"""What the whole policy chain costs per request: auth, rate limits, guardrails, OPA and audit.

Method
------
Two apps built by ``gateway.app.create_app`` over the same loaded model (the
bundled SmolLM2 on the CPU backend) and the same policy store (SQLite in a
temporary directory), driven in-process through ``httpx.ASGITransport`` (no
sockets, whose noise would swamp the difference):

* ``off``: an authenticator that returns a fixed principal without work, no
  rate limiter, no guardrails, no OPA, no audit trail;
* ``on``: everything as served: a real API key, a tenant ``rate_limit`` policy
  (requests, tokens and concurrency per minute) and a monthly ``quota``, a
  ``guardrail`` policy with 20 blocklist words, every PII detector (e-mail in
  redact mode, the rest in log mode) on input and output, an embedded Rego
  policy, and the audit trail waiting for each event's fsync before answering
  (the default), with its store indexer running.

The request is ``POST /v1/completions`` with a 12-token prompt that holds an
e-mail address and ``max_tokens: 1``, so generation (one prefill step) stays
small next to the gateway's own work but real. Latency: the two apps alternate
in rounds of sequential requests; *added* is ``on``'s percentile minus
``off``'s. Throughput: requests/s with ``--concurrency`` clients in flight,
alternating too. Medians over rounds are reported.

Usage:
    .venv/bin/python benchmarks/bench_policy.py [--requests 300] [--rounds 3] [--concurrency 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from backends.base import ModelSpec  # noqa: E402
from backends.engine import EngineConfig  # noqa: E402
from backends.models import default_model_path  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.models import ModelManager, load_served_model  # noqa: E402
from gateway.settings import DEFAULT_MODEL_NAME, Settings  # noqa: E402
from policy.guardrails import EMPTY  # noqa: E402
from policy.rbac import Principal  # noqa: E402
from policy.store import PolicyStore  # noqa: E402

from bench_auth import FixedPrincipal, pct  # noqa: E402  (this folder is on sys.path)

PROMPT = "Please write back to jane.doe@example.com about the"
REGO = """package inferflux.guardrails
default decision := {"allow": true}
decision := {"allow": false, "reasons": ["model not allowed"]} if { input.model == "forbidden" }
"""
WORDS = [f"blockedword{i}" for i in range(20)]


class _Admit:
    handle = None
    headers: dict[str, str] = {}


class NoLimits:
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def check_and_reserve(self, principal: Any, **_: Any) -> _Admit:
        return _Admit()

    async def settle(self, *_: Any) -> None: ...


class NoGuardrails:
    async def resolve(self, tenant_id: str | None) -> Any:
        return EMPTY

    async def aclose(self) -> None: ...


class NoTraffic:
    """The ``off`` variant's traffic policy: nothing to check, no audit trail."""

    limiter = NoLimits()
    guardrails = NoGuardrails()
    audit_store = None
    digester = None

    async def start(self) -> None:
        return None

    async def close(self) -> None: ...


async def sequential(client: httpx.AsyncClient, headers: dict[str, str], n: int) -> list[float]:
    out = []
    body = {"model": DEFAULT_MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    for _ in range(n):
        start = time.perf_counter()
        response = await client.post("/v1/completions", json=body, headers=headers)
        out.append(time.perf_counter() - start)
        if response.status_code != 200:
            raise SystemExit(f"unexpected {response.status_code}: {response.text}")
    return out


async def throughput(client: httpx.AsyncClient, headers: dict[str, str], n: int, concurrency: int) -> float:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            response = await client.post("/v1/completions", json=body, headers=headers)
            if response.status_code != 200:
                raise SystemExit(f"unexpected {response.status_code}: {response.text}")

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - start)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix="bench-policy-"))
    store = PolicyStore.open(Settings(data_dir=data_dir).store, data_dir)
    store.ensure_bootstrap_admin()
    tenant = store.create_tenant("bench")
    _, key = store.create_api_key(tenant.id, "bench", "member")
    store.create_policy(tenant.id, "rate_limit", "bench", {
        "scope": "tenant", "requests_per_minute": 1_000_000, "tokens_per_minute": 1_000_000_000,
        "concurrent_requests": 10_000,
    })
    store.create_policy(tenant.id, "quota", "bench", {"scope": "tenant", "period": "month", "tokens": 10**12})
    pii = {kind: "log" for kind in ("phone", "card", "iban", "ssn", "ip", "secret")}
    store.create_policy(tenant.id, "guardrail", "bench", {
        "blocklist": [{"id": f"w{i}", "literal": w} for i, w in enumerate(WORDS)],
        "pii": {"email": "redact", **pii},
        "opa": {"engine": "embedded", "rego": REGO},
    })
    spec = ModelSpec(name=DEFAULT_MODEL_NAME, path=default_model_path(), dtype=args.dtype)
    served = load_served_model(spec, "cpu", EngineConfig(kv_cache_bytes=64 * 1024 * 1024))
    manager = ModelManager(expected=[served.name])
    manager.add(served)
    principal = Principal(tenant_id=tenant.id, tenant_name="bench", subject="key:bench", kind="api_key",
                          roles=frozenset({"member"}))
    apps = {
        "off": create_app(Settings(data_dir=data_dir / "off"), manager, store=store,
                          authenticator=FixedPrincipal(store, principal), traffic=NoTraffic(),  # type: ignore[arg-type]
                          owns_models=False),
        "on": create_app(Settings(data_dir=data_dir / "on"), manager, store=store, owns_models=False),
    }
    headers = {"off": {}, "on": {"authorization": f"Bearer {key}"}}
    latency: dict[str, list[list[float]]] = {name: [] for name in apps}
    rps: dict[str, list[float]] = {name: [] for name in apps}
    async with apps["off"].router.lifespan_context(apps["off"]), apps["on"].router.lifespan_context(apps["on"]):
        clients = {
            name: httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench", timeout=60)
            for name, app in apps.items()
        }
        for name in apps:  # warm-up: caches, compiled Rego, the first fsyncs
            await sequential(clients[name], headers[name], 20)
        for r in range(args.rounds):
            order = list(apps) if r % 2 == 0 else list(reversed(apps))
            for name in order:
                latency[name].append(await sequential(clients[name], headers[name], args.requests))
            for name in order:
                rps[name].append(await throughput(clients[name], headers[name], args.requests, args.concurrency))
        for client in clients.values():
            await client.aclose()
    served.shutdown()
    store.close()

    def summary(name: str) -> dict[str, float]:
        rounds = latency[name]
        return {
            "p50_ms": statistics.median(pct(r, 50) for r in rounds) * 1000,
            "p99_ms": statistics.median(pct(r, 99) for r in rounds) * 1000,
            "rps": statistics.median(rps[name]),
        }

    off, on = summary("off"), summary("on")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
        "requests": args.requests, "rounds": args.rounds, "concurrency": args.concurrency, "dtype": args.dtype,
        "off": off, "on": on,
        "added_p50_ms": on["p50_ms"] - off["p50_ms"],
        "added_p99_ms": on["p99_ms"] - off["p99_ms"],
        "rps_ratio": on["rps"] / off["rps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("Method")[0].strip())
    parser.add_argument("--requests", type=int, default=300, help="requests per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16, help="clients in flight for requests/s")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print(__doc__.split("Usage:")[0].strip())
    print()
    print(f"{args.rounds} rounds x {args.requests} requests per variant; throughput at concurrency {args.concurrency}")
    print("| variant | p50 ms | p99 ms | requests/s |")
    print("|---|---|---|---|")
    for name in ("off", "on"):
        row = report[name]
        print(f"| {name} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {row['rps']:.1f} |")
    print(f"\nadded by the policy chain: p50 {report['added_p50_ms']:+.2f} ms, p99 {report['added_p99_ms']:+.2f} ms; "
          f"requests/s on/off = {report['rps_ratio']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
