#!/usr/bin/env python3
"""What the whole policy chain costs per request: auth, rate limits, guardrails, OPA and audit.

Method
------
Five apps built by ``gateway.app.create_app`` over the same loaded model (the
bundled SmolLM2 on the CPU backend) and the same policy store (SQLite in a
temporary directory), driven in-process through ``httpx.ASGITransport`` (no
sockets, whose noise would swamp the difference):

* ``off``: an authenticator that returns a fixed principal without work, no
  rate limiter, no guardrails, no OPA, no audit trail;
* ``on``: everything as served: a real API key, a tenant ``rate_limit`` policy
  (requests, tokens and concurrency per minute) and a monthly ``quota``, a
  ``guardrail`` policy with 20 blocklist words, every PII detector (e-mail in
  redact mode, the rest in log mode) on input and output, a global guardrail
  policy with an embedded Rego access policy (the operator's, so evaluated
  inline; it reads only the model, so after the first request its decision is
  remembered), and the audit trail writing each event to its spool before answering
  (the default: what a ``kill -9`` of the gateway cannot take back), with its
  store indexer running;
* ``on-fsync``: the same with ``audit.wait_durable: true``, which also waits
  for each event's fsync before answering (what a crash of the machine cannot
  take back): what that guarantee costs;
* ``on-opa-uncached``: ``on`` with the global policy's decisions never
  remembered: what the operator's policy costs when it reads a field that
  changes with every request (the request id, the prompt's token count);
* ``on-tenant-rego``: ``on`` for a second tenant whose guardrail policy also
  has a Rego policy of its own, one that reads the request id, so that no
  decision of it can be remembered (``policy.guardrails.opa_cache``): a
  tenant's policy is evaluated on the OPA thread pool, beside the engine, for
  every request: what a tenant's uncacheable Rego adds;
* with ``--decode``, the ``guardrail`` policy of ``on`` (and of every variant
  built on it) also decodes base64 and hex spans of the input and checks the
  blocklist on them (``spec.decode``, which a policy turns on);
* ``on-traced`` (with ``--traced``): ``on`` with ``tracing.enabled``, every
  request sampled, a span per stage made and ended on the request path, exported
  where ``OTEL_TRACES_EXPORTER`` says (``none`` unless it is set): what tracing
  adds to the request; its ``on`` variant is the chain with tracing off.

The request is ``POST /v1/completions`` with a 12-token prompt that holds an
e-mail address (``off`` sends it already redacted, so the engine's work is the
same) and ``max_tokens: 1``, so generation (one prefill step) stays
small next to the gateway's own work but real.

Latency: ``--rounds`` rounds; in each, every variant sends ``--requests``
sequential requests, the variants taking turns in a rotating order. The
machine's speed drifts over minutes (a shared host: the same variant's median
moved by 4 ms between rounds in our runs), by more than the chain costs, so
each round's ``on`` median is compared with the same round's ``off`` median:
*added* at p50 is the median over rounds of those paired differences; p99 is
over every request of a variant. Generation also varies from request to
request, so each request's *gateway time* is reported too: its end-to-end
latency minus the time it spent inside the engine (from ``engine.stream``
being called to its last output, timed by a wrapper around the shared
engine). The rounds' end-to-end figure stays uncertain by about a millisecond
(generation varies by several from request to request), so ``--pairs`` pairs
of an ``off`` and an ``on`` request, alternating request by request, give it
again to a tenth of a millisecond, with the CPU the chain's own threads (audit
indexer and fsync, housekeeping) spent per request besides (``policy_paired.py``
says why both are needed). Throughput: requests/s with ``--concurrency`` clients in flight over
``--throughput-requests`` requests, alternating, for ``--throughput-rounds``
rounds; medians. Last, each stage of the chain is timed alone (its own
objects in the ``on`` app, the engine idle), to tell its intrinsic cost from
what contention on a busy machine adds.

``--stand-in-engine`` replaces generation with a stand-in that answers one
token at once (the model is still loaded, for its tokenizer): the variants then
differ only in the gateway's own work, without the engine's threads competing
for the two cores. A diagnostic, not the acceptance figure. ``--sweep-mb N``
reads N MB of memory before each paired request, untimed: a real generation
streams the model's weights through the CPU's caches between two requests, so
the chain's code and data are cold when the next one comes; with the stand-in
engine and 256 MB the chain costs about twice what it costs hot. ``--gap-ms N``
spins N ms before each paired request instead (or as well): on the shared
hosts measured, 10 ms of a loop that touches nothing made the next request as
slow as a sweep or a forward did, so the time between requests, not the
weights' traffic, is what makes the chain cost more in a request than hot.

Usage:
    .venv/bin/python benchmarks/bench_policy.py [--requests 60] [--rounds 20] [--pairs 400] [--concurrency 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import AsyncIterator
from typing import Any


import httpx  # noqa: E402

from inferflux.backends.base import ModelSpec  # noqa: E402
from inferflux.backends.engine import EngineConfig, RequestOutput  # noqa: E402
from inferflux.backends.models import default_model_path  # noqa: E402
from inferflux.gateway.app import create_app  # noqa: E402
from inferflux.gateway.models.served import ModelManager, load_served_model  # noqa: E402
from inferflux.gateway.settings import DEFAULT_MODEL_NAME, AuditSettings, Settings, TracingSettings  # noqa: E402
from inferflux.policy.audit.events import api_event  # noqa: E402
from inferflux.policy.guardrails import EMPTY, opa_input  # noqa: E402
from inferflux.policy.guardrails.opa import EmbeddedRego  # noqa: E402
from inferflux.policy.guardrails.opa_cache import DecisionCache  # noqa: E402
from inferflux.policy.guardrails.spec import OpaSettings  # noqa: E402
from inferflux.policy.ratelimit import DEFAULT_SCHEDULING, Scheduling  # noqa: E402
from inferflux.policy.rbac import Principal  # noqa: E402
from inferflux.policy.store import PolicyStore  # noqa: E402

from bench_auth import FixedPrincipal, pct  # noqa: E402  (this folder is on sys.path)
from policy_paired import before_each, paired_requests, thread_ids, timed  # noqa: E402

PROMPT = "Please write back to jane.doe@example.com about the"
# What the model sees once ``on`` has redacted PROMPT: ``off`` sends it as is, so
# that both variants give the engine the same tokens.
REDACTED_PROMPT = "Please write back to [EMAIL] about the"
REGO = """package inferflux.guardrails
default decision := {"allow": true}
decision := {"allow": false, "reasons": ["model not allowed"]} if { input.model == "forbidden" }
"""
# The second tenant's own policy also reads the request id: no two requests share a decision.
TENANT_REGO = REGO.replace('input.model == "forbidden"', 'input.model == "forbidden"; input.request_id != ""')
WORDS = [f"blockedword{i}" for i in range(20)]
ON_STAGES = ("input guardrails", "output guardrails (stream)", "OPA, the global policy (inline, remembered)",
             "rate limit + quota (reserve, settle)", "audit event, written")


class _Admit:
    handle = None
    headers: dict[str, str] = {}


class NoLimits:
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def scheduling_for(self, principal: Any) -> Scheduling:
        return DEFAULT_SCHEDULING

    async def check_and_reserve(self, principal: Any, **_: Any) -> _Admit:
        return _Admit()

    async def settle(self, *_: Any) -> None: ...


class NoGuardrails:
    async def resolve(self, tenant_id: str | None) -> Any:
        return EMPTY

    async def aclose(self) -> None: ...


class NoPrices:
    async def price_for(self, model: str) -> None:
        return None


class NoTraffic:
    """The ``off`` variant's traffic policy: nothing to check, no audit trail."""

    limiter = NoLimits()
    guardrails = NoGuardrails()
    prices = NoPrices()
    audit_store = None
    digester = None

    async def start(self) -> None:
        return None

    def observe_policy_version(self, version: int) -> None: ...

    async def close(self) -> None: ...


class EngineClock:
    """Wraps ``engine.stream`` (what the gateway calls) to time each call from start to its last output."""

    def __init__(self, engine: Any) -> None:
        self.seconds: list[float] = []
        inner = engine.stream

        async def stream(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            start = time.perf_counter()
            try:
                async for output in inner(*args, **kwargs):
                    yield output
            finally:
                self.seconds.append(time.perf_counter() - start)

        engine.stream = stream


async def stand_in_stream(request: Any) -> AsyncIterator[Any]:
    """One finished output at once: the engine's answer without the engine."""
    yield RequestOutput(request.request_id, [42], " the", True, "length", len(request.prompt), 1)


def body_for(headers: dict[str, str]) -> dict[str, Any]:
    prompt = PROMPT if headers else REDACTED_PROMPT  # only ``off`` sends no credentials
    return {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}


async def sequential(
    client: httpx.AsyncClient, headers: dict[str, str], n: int, clock: EngineClock
) -> tuple[list[float], list[float]]:
    """End-to-end latencies and gateway times (end-to-end minus in-engine) of ``n`` requests in a row."""
    total, gateway = [], []
    body = body_for(headers)
    for _ in range(n):
        clock.seconds.clear()
        start = time.perf_counter()
        response = await client.post("/v1/completions", json=body, headers=headers)
        elapsed = time.perf_counter() - start
        if response.status_code != 200:
            raise SystemExit(f"unexpected {response.status_code}: {response.text}")
        if len(clock.seconds) != 1:
            raise SystemExit(f"expected one engine call per request, saw {len(clock.seconds)}")
        total.append(elapsed)
        gateway.append(elapsed - clock.seconds[0])
    return total, gateway


async def one(client: httpx.AsyncClient, headers: dict[str, str]) -> None:
    response = await client.post("/v1/completions", json=body_for(headers), headers=headers)
    if response.status_code != 200:
        raise SystemExit(f"unexpected {response.status_code}: {response.text}")


async def throughput(client: httpx.AsyncClient, headers: dict[str, str], n: int, concurrency: int) -> float:
    body = body_for(headers)
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            response = await client.post("/v1/completions", json=body, headers=headers)
            if response.status_code != 200:
                raise SystemExit(f"unexpected {response.status_code}: {response.text}")

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - start)


async def components(
    app: Any, principal: Principal, own: Principal, durable_trail: Any, n: int = 500
) -> dict[str, dict[str, float]]:
    """Each stage of the chain alone, on the ``on`` app's own objects, with the engine idle: p50/p99 in ms.

    ``durable_trail``: the ``on-fsync`` app's audit trail, whose spool fsyncs at once (``on``'s waits out
    its interval between fsyncs, as nothing there waits for them).
    """
    state = app.state
    guards = await state.guardrails.resolve(principal.tenant_id)
    own_guards = await state.guardrails.resolve(own.tenant_id)
    opa_doc = opa_input(principal, model=DEFAULT_MODEL_NAME, route="/v1/completions", prompt_tokens=12,
                        max_completion_tokens=1)
    own_doc = opa_input(own, model=DEFAULT_MODEL_NAME, route="/v1/completions", prompt_tokens=12,
                        max_completion_tokens=1)
    request_ids = (f"req_bench{i}" for i in itertools.count())  # the tenant's policy reads it: a new one each time

    def output_stream() -> None:
        stream = guards.output_stream()
        stream.feed(" the weather today")
        stream.flush()

    async def limiter() -> None:
        admission = await state.limiter.check_and_reserve(principal, prompt_tokens=12, max_tokens=1)
        await state.limiter.settle(admission.handle, 12, 1)

    def event() -> Any:
        return api_event(
            decision="allow", digester=state.traffic.digester, prompt=PROMPT, completion=" the",
            request_id="bench", tenant_id=principal.tenant_id, principal=principal.subject, route="/v1/completions",
            model=DEFAULT_MODEL_NAME, prompt_tokens=12, completion_tokens=1, status=200, latency_ms=50.0,
        )

    async def audit_written() -> None:
        await state.audit_trail.record(event())  # the default: returns once written

    async def audit_fsynced() -> None:
        await durable_trail.spool.append(event())  # the receipt resolves once fsynced

    uncached = EmbeddedRego("uncached", OpaSettings(engine="embedded", timeout_ms=100, fail_open=False, rego=REGO),
                            inline=True)
    uncached.cache = DecisionCache(None)
    stages: dict[str, Any] = {  # ON_STAGES names those the ``on`` variant runs
        "input guardrails": lambda: guards.check_input([PROMPT]),
        "output guardrails (stream)": output_stream,
        "OPA, the global policy (inline, remembered)": lambda: guards.authorize_inline(opa_doc),
        "OPA, the same policy not cached (inline)": lambda: uncached.decide_now(opa_doc),
        "OPA, a tenant's policy (thread pool, not cached)": lambda: own_guards.authorize_deferred(
            {**own_doc, "request_id": next(request_ids)}
        ),
        "rate limit + quota (reserve, settle)": limiter,
        "audit event, written": audit_written,
        "audit event, fsynced": audit_fsynced,
    }
    out = {}
    for name, stage in stages.items():
        times = []
        for _ in range(n):
            start = time.perf_counter()
            result = stage()
            if asyncio.iscoroutine(result):
                await result
            times.append(time.perf_counter() - start)
        out[name] = {"p50_ms": pct(times, 50) * 1000, "p99_ms": pct(times, 99) * 1000}
    return out


@dataclass
class Setup:
    """The variants' apps over one loaded model and one policy store (``setup``)."""

    apps: dict[str, Any]
    headers: dict[str, dict[str, str]]
    served: Any
    store: PolicyStore
    principal: Principal
    own_principal: Principal  # the tenant with a Rego policy of its own

    def close(self) -> None:
        self.served.shutdown()
        self.store.close()


def setup(dtype: str, *, stand_in_engine: bool = False, traced: bool = False, decode: bool = False) -> Setup:
    """The store with the ``on`` tenant's policies, the model, and the three apps (not started); ``decode``: the
    guardrail policy also checks the blocklist on base64 and hex spans of the input, decoded."""
    data_dir = Path(tempfile.mkdtemp(prefix="bench-policy-"))
    store = PolicyStore.open(Settings(data_dir=data_dir).store, data_dir)
    store.ensure_bootstrap_admin()
    tenant, own = store.create_tenant("bench"), store.create_tenant("bench-rego")
    _, key = store.create_api_key(tenant.id, "bench", "member")
    _, own_key = store.create_api_key(own.id, "bench", "member")
    pii = {kind: "log" for kind in ("phone", "card", "iban", "ssn", "ip", "secret")}
    guardrail: dict[str, Any] = {"blocklist": [{"id": f"w{i}", "literal": w} for i, w in enumerate(WORDS)],
                                 "pii": {"email": "redact", **pii}}
    if decode:
        guardrail["decode"] = ["base64", "hex"]
    for tenant_id in (tenant.id, own.id):
        store.create_policy(tenant_id, "rate_limit", "bench", {
            "scope": "tenant", "requests_per_minute": 1_000_000, "tokens_per_minute": 1_000_000_000,
            "concurrent_requests": 10_000,
        })
        store.create_policy(tenant_id, "quota", "bench", {"scope": "tenant", "period": "month", "tokens": 10**12})
    store.create_policy(tenant.id, "guardrail", "bench", guardrail)
    # The operator's access policy, global, so evaluated inline (policy.guardrails.opa).
    store.create_policy(None, "guardrail", "access", {"opa": {"engine": "embedded", "rego": REGO}})
    # The second tenant also has a Rego policy of its own: a tenant's, evaluated on the OPA pool beside the engine,
    # and one that reads the request id, so never remembered.
    store.create_policy(own.id, "guardrail", "bench", {**guardrail, "opa": {"engine": "embedded", "rego": TENANT_REGO}})
    spec = ModelSpec(name=DEFAULT_MODEL_NAME, path=default_model_path(), dtype=dtype)
    served = load_served_model(spec, "cpu", EngineConfig(kv_cache_bytes=64 * 1024 * 1024))
    if stand_in_engine:
        served.engine.stream = stand_in_stream  # type: ignore[method-assign]
    manager = ModelManager(expected=[served.name])
    manager.add(served)
    principal = Principal(tenant_id=tenant.id, tenant_name="bench", subject="key:bench", kind="api_key",
                          roles=frozenset({"member"}))
    apps = {
        "off": create_app(Settings(data_dir=data_dir / "off"), manager, store=store,
                          authenticator=FixedPrincipal(store, principal), traffic=NoTraffic(),  # type: ignore[arg-type]
                          owns_models=False),
        "on": create_app(Settings(data_dir=data_dir / "on"), manager, store=store, owns_models=False),
        "on-fsync": create_app(
            Settings(data_dir=data_dir / "on-fsync", audit=AuditSettings(wait_durable=True)), manager, store=store,
            owns_models=False,
        ),
    }
    apps["on-opa-uncached"] = create_app(Settings(data_dir=data_dir / "on-opa-uncached"), manager, store=store,
                                         owns_models=False)  # its engines' caches are turned off once built (run)
    apps["on-tenant-rego"] = create_app(Settings(data_dir=data_dir / "on-tenant-rego"), manager, store=store,
                                        owns_models=False)
    if traced:
        apps["on-traced"] = create_app(Settings(data_dir=data_dir / "on-traced", tracing=TracingSettings(enabled=True)),
                                       manager, store=store, owns_models=False)  # fmt: skip
    bearer, own_bearer = {"authorization": f"Bearer {key}"}, {"authorization": f"Bearer {own_key}"}
    headers = {"off": {}, "on": bearer, "on-fsync": bearer, "on-opa-uncached": bearer, "on-tenant-rego": own_bearer,
               "on-traced": bearer}  # fmt: skip
    own_principal = Principal(tenant_id=own.id, tenant_name="bench-rego", subject="key:bench", kind="api_key",
                              roles=frozenset({"member"}))
    return Setup(apps, headers, served, store, principal, own_principal)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.traced:  # spans made and ended on the request path; exported nowhere unless the OTEL_* variables say
        os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")
    bench = setup(args.dtype, stand_in_engine=args.stand_in_engine, traced=args.traced, decode=args.decode)
    apps, headers, principal = bench.apps, bench.headers, bench.principal
    clock = EngineClock(bench.served.engine)
    # Per variant, per round: the round's requests' end-to-end latencies and gateway times (seconds).
    latency: dict[str, list[list[float]]] = {name: [] for name in apps}
    gateway: dict[str, list[list[float]]] = {name: [] for name in apps}
    rps: dict[str, list[float]] = {name: [] for name in apps}
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(bench.close)  # last, and also when a request fails: the engine's thread would keep the process
        started: dict[str, set[int]] = {}  # the threads each app started (its audit trail's, say)
        for name, app in apps.items():
            before = thread_ids()
            await stack.enter_async_context(app.router.lifespan_context(app))
            # Only the audit trail's: the AnyIO and asyncio pools a start creates serve every app.
            started[name] = {t.ident for t in threading.enumerate() if t.ident in thread_ids() - before
                             and t.name.startswith("audit-")}
        clients = {
            name: httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench", timeout=60)
            for name, app in apps.items()
        }
        for name in apps:  # warm-up: caches, compiled Rego, the first fsyncs
            await sequential(clients[name], headers[name], 20, clock)
        uncached = await apps["on-opa-uncached"].state.guardrails.resolve(principal.tenant_id)
        for engine in uncached.engines:  # this app's own engines: the others keep their caches
            engine.cache = DecisionCache(None)  # type: ignore[attr-defined]
        for r in range(args.rounds):
            for name in _rotated(list(apps), r):
                total, own = await sequential(clients[name], headers[name], args.requests, clock)
                latency[name].append(total)
                gateway[name].append(own)
        sweep = before_each(args.sweep_mb, args.gap_ms)
        pairs = await paired_requests(timed(lambda: one(clients["off"], headers["off"]), sweep),
                                      timed(lambda: one(clients["on"], headers["on"]), sweep), args.pairs,
                                      started["on"]) if args.pairs else None
        for r in range(args.throughput_rounds):
            for name in _rotated(list(apps), r):
                rps[name].append(
                    await throughput(clients[name], headers[name], args.throughput_requests, args.concurrency)
                )
        for client in clients.values():
            await client.aclose()
        stages = await components(apps["on"], principal, bench.own_principal, apps["on-fsync"].state.audit_trail)

    def summary(name: str) -> dict[str, float]:
        return {
            "p50_ms": statistics.median(pct(r, 50) for r in latency[name]) * 1000,
            "p99_ms": pct([x for r in latency[name] for x in r], 99) * 1000,
            "gateway_p50_ms": statistics.median(pct(r, 50) for r in gateway[name]) * 1000,
            "gateway_p99_ms": pct([x for r in gateway[name] for x in r], 99) * 1000,
            "rps": statistics.median(rps[name]) if rps[name] else math.nan,  # nan: --throughput-rounds 0
        }

    def added(name: str, q: float, rounds: dict[str, list[list[float]]], base: str = "off") -> float:
        """ms ``name`` adds to ``base`` at percentile ``q``: p50 paired round by round, p99 over all requests."""
        if q == 50:
            return statistics.median(pct(a, 50) - pct(b, 50) for a, b in zip(rounds[name], rounds[base])) * 1000
        pooled = {n: [x for r in rounds[n] for x in r] for n in (name, base)}
        return (pct(pooled[name], q) - pct(pooled[base], q)) * 1000

    off, on, fsync, own = summary("off"), summary("on"), summary("on-fsync"), summary("on-tenant-rego")
    uncached = summary("on-opa-uncached")
    paired = [round((pct(a, 50) - pct(b, 50)) * 1000, 3) for a, b in zip(latency["on"], latency["off"])]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
        "requests": args.requests, "rounds": args.rounds, "concurrency": args.concurrency, "dtype": args.dtype,
        "throughput_requests": args.throughput_requests, "throughput_rounds": args.throughput_rounds,
        "engine": "stand-in" if args.stand_in_engine else "SmolLM2 on cpu",
        "off": off, "on": on, "on-fsync": fsync, "on-opa-uncached": uncached, "on-tenant-rego": own,
        "added_p50_ms": added("on", 50, latency),
        "added_p99_ms": added("on", 99, latency),
        "added_gateway_p50_ms": added("on", 50, gateway),
        "added_gateway_p99_ms": added("on", 99, gateway),
        "added_p50_ms_by_round": paired,
        "rps_ratio": on["rps"] / off["rps"],
        "fsync_added_gateway_p50_ms": added("on-fsync", 50, gateway),
        "fsync_added_p50_ms": added("on-fsync", 50, latency),
        "fsync_rps_ratio": fsync["rps"] / off["rps"],
        "opa_uncached_added_p50_ms": added("on-opa-uncached", 50, latency),
        "opa_uncached_added_gateway_p50_ms": added("on-opa-uncached", 50, gateway),
        "opa_uncached_rps_ratio": uncached["rps"] / off["rps"],
        "tenant_rego_added_p50_ms": added("on-tenant-rego", 50, latency),
        "tenant_rego_added_gateway_p50_ms": added("on-tenant-rego", 50, gateway),
        "tenant_rego_rps_ratio": own["rps"] / off["rps"],
        "components": stages,
        "paired": pairs,
        "sweep_mb": args.sweep_mb,
        "gap_ms": args.gap_ms,
        "decode": args.decode,
        **({"on-traced": summary("on-traced"), "traced_added_to_on_p50_ms": added("on-traced", 50, latency, "on"),
            "traced_added_to_on_gateway_p50_ms": added("on-traced", 50, gateway, "on")} if args.traced else {}),
    }


def _rotated(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: each variant goes first in turn."""
    return names[r % len(names):] + names[: r % len(names)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("Method")[0].strip())
    parser.add_argument("--requests", type=int, default=60, help="sequential requests per variant per round")
    parser.add_argument("--rounds", type=int, default=20, help="latency rounds (each variant once per round)")
    parser.add_argument("--concurrency", type=int, default=16, help="clients in flight for requests/s")
    parser.add_argument("--throughput-requests", type=int, default=300, help="requests per requests/s measurement")
    parser.add_argument("--throughput-rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=400,
                        help="off/on request pairs, alternating request by request (policy_paired.py); 0: none")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--sweep-mb", type=int, default=0,
                        help="before each paired request, read this many MB of memory (untimed): with "
                             "--stand-in-engine, the caches as a real generation leaves them (256 does)")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="before each paired request, spin this long (untimed): with --stand-in-engine, the "
                             "time a generation takes between two requests without its memory traffic")
    parser.add_argument("--stand-in-engine", action="store_true",
                        help="answer at once instead of generating: the gateway's own cost alone (a diagnostic)")
    parser.add_argument("--traced", action="store_true",
                        help="add on-traced: on with tracing.enabled (OTEL_TRACES_EXPORTER, default here none)")
    parser.add_argument("--decode", action="store_true",
                        help="the guardrail policy also decodes base64 and hex spans of the input for the blocklist "
                             "(spec.decode, off by default)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print(__doc__.split("Usage:")[0].strip())
    print()
    print(f"{args.rounds} rounds x {args.requests} sequential requests per variant; requests/s: "
          f"{args.throughput_rounds} rounds x {args.throughput_requests} requests at concurrency {args.concurrency}")
    print("| variant | end-to-end p50 ms | p99 ms | gateway time p50 ms | p99 ms | requests/s |")
    print("|---|---|---|---|---|---|")
    for name in ("off", "on", "on-fsync", "on-opa-uncached", "on-tenant-rego", *(("on-traced",) if args.traced else ())):
        row = report[name]
        print(f"| {name} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {row['gateway_p50_ms']:.2f} "
              f"| {row['gateway_p99_ms']:.2f} | {row['rps']:.1f} |")
    print("\nadded by the policy chain (p50: the median over rounds of on minus off in the same round; p99: over "
          "every request):")
    print(f"gateway time: p50 {report['added_gateway_p50_ms']:+.2f} ms, "
          f"p99 {report['added_gateway_p99_ms']:+.2f} ms; end to end: p50 {report['added_p50_ms']:+.2f} ms, "
          f"p99 {report['added_p99_ms']:+.2f} ms; requests/s on/off = {report['rps_ratio']:.2f}")
    print(f"with audit.wait_durable: true: p50 {report['fsync_added_p50_ms']:+.2f} ms end to end, "
          f"gateway time p50 {report['fsync_added_gateway_p50_ms']:+.2f} ms, "
          f"requests/s on-fsync/off = {report['fsync_rps_ratio']:.2f}")
    print(f"end-to-end p50 added, round by round: {report['added_p50_ms_by_round']}")
    if (pairs := report["paired"]) is not None:
        low, high = pairs["added_p50_ci95_ms"]
        before = [f"reading {report['sweep_mb']} MB"] if report["sweep_mb"] else []
        before += [f"a {report['gap_ms']:g} ms spin"] if report["gap_ms"] else []
        swept = f" (each after {' and '.join(before)})" if before else ""
        print(f"end to end, {pairs['pairs']} off/on pairs alternating request by request{swept}: p50 added "
              f"{pairs['added_p50_ms']:+.2f} ms (95 % interval {low:+.2f} to {high:+.2f}); the threads the on app "
              f"started (audit indexer, fsync, housekeeping) used {pairs['chain_threads_cpu_ms_per_request']:.3f} ms "
              "of CPU per on request besides")
    print(f"with the global policy's decisions not cached: p50 {report['opa_uncached_added_p50_ms']:+.2f} ms end to end, "
          f"gateway time p50 {report['opa_uncached_added_gateway_p50_ms']:+.2f} ms, "
          f"requests/s on-opa-uncached/off = {report['opa_uncached_rps_ratio']:.2f}")
    print(f"with a tenant's own, uncacheable Rego policy too: p50 {report['tenant_rego_added_p50_ms']:+.2f} ms end to end, "
          f"gateway time p50 {report['tenant_rego_added_gateway_p50_ms']:+.2f} ms, "
          f"requests/s on-tenant-rego/off = {report['tenant_rego_rps_ratio']:.2f}")
    if args.traced:
        print(f"with tracing on (on-traced minus on, same round): p50 {report['traced_added_to_on_p50_ms']:+.2f} ms "
              f"end to end, gateway time p50 {report['traced_added_to_on_gateway_p50_ms']:+.2f} ms")
    print("\neach stage alone, engine idle (500 calls):")
    print("| stage | p50 ms | p99 ms |")
    print("|---|---|---|")
    for name, row in report["components"].items():
        print(f"| {name} | {row['p50_ms']:.3f} | {row['p99_ms']:.3f} |")
    total = sum(row["p50_ms"] for name, row in report["components"].items() if name in ON_STAGES)
    print(f"| sum of the stages `on` runs (not the tenant policy, not the fsync) | {total:.3f} | |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
