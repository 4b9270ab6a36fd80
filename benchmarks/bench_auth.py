#!/usr/bin/env python3
"""What authentication and RBAC add to each request: API keys and OIDC JWTs.

Method
------
One app (``gateway.app.create_app``) over a real policy store (SQLite in a
temporary directory by default, or ``--store-url``) and no model, so what is
measured is the gateway's own path, not generation. Requests go through the
whole ASGI stack in-process (``httpx.ASGITransport``: no sockets, whose noise
would swamp the difference) to ``GET /v1/models``, which requires the ``read``
scope and filters by the caller's model allow-list.

Three variants of the same request, alternating in rounds so that machine
noise hits them alike:

* ``baseline``: an authenticator that returns a fixed principal without any
  work: the route, the middleware stack and the scope check, minus authentication;
* ``api_key``: ``Authorization: Bearer ifx_...`` (a member key);
* ``jwt``: ``Authorization: Bearer <RS256 JWT>`` of a registered OIDC provider,
  its JWKS fetched once and cached (the provider is served by an in-memory
  ``httpx.MockTransport``; nothing leaves the process).

The added latency is each variant's percentile minus the baseline's. Decisions
are cached in the gateway (``auth.cache_ttl_seconds``), so a steady client pays
the cached cost; the cold cost (a new credential, or the first request after a
policy change drops the caches) is measured separately by calling
``Authenticator.authenticate`` with the cache cleared before each call:
a store lookup plus an HMAC for a key, a signature check plus a role-binding
lookup for a JWT.

Usage:
    .venv/bin/python benchmarks/bench_auth.py [--requests 2000] [--rounds 5] [--store-url postgresql://...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


import httpx  # noqa: E402
from joserfc import jwt  # noqa: E402
from joserfc.jwk import RSAKey  # noqa: E402

from inferflux.gateway.app import create_app  # noqa: E402
from inferflux.gateway.auth import Authenticator  # noqa: E402
from inferflux.gateway.models.served import ModelManager  # noqa: E402
from inferflux.gateway.settings import Settings  # noqa: E402
from inferflux.policy.authn.oidc import OidcVerifier  # noqa: E402
from inferflux.policy.rbac import Principal  # noqa: E402
from inferflux.policy.store import PolicyStore, StoreSettings  # noqa: E402

ISSUER = "https://idp.bench.example"
AUDIENCE = "inferflux"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


class FixedPrincipal(Authenticator):
    """The baseline: authentication that costs nothing."""

    def __init__(self, store: PolicyStore, principal: Principal) -> None:
        super().__init__(store)
        self.principal = principal

    async def authenticate(self, authorization: str | None, api_key: str | None) -> Principal:
        return self.principal


def mock_idp(key: RSAKey) -> httpx.AsyncClient:
    """An OIDC provider answered in memory: discovery and JWKS, counted."""
    fetches = {"jwks": 0}
    jwks = {"keys": [key.as_dict(private=False, kid="bench-1", use="sig", alg="RS256")]}

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/.well-known/openid-configuration":
            return httpx.Response(200, json={"issuer": ISSUER, "jwks_uri": f"{ISSUER}/jwks.json"})
        if request.url.path == "/jwks.json":
            fetches["jwks"] += 1
            return httpx.Response(200, json=jwks)
        return httpx.Response(404)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    client.fetches = fetches  # type: ignore[attr-defined]
    return client


def mint(key: RSAKey, subject: str) -> str:
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": AUDIENCE, "sub": subject, "tenant": "bench", "roles": ["member"],
              "iat": now, "exp": now + 3600}
    return jwt.encode({"alg": "RS256", "kid": "bench-1"}, claims, key)


async def timed_requests(client: httpx.AsyncClient, headers: dict[str, str], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        response = await client.get("/v1/models", headers=headers)
        out.append(time.perf_counter() - start)
        if response.status_code != 200:
            raise SystemExit(f"unexpected {response.status_code}: {response.text}")
    return out


async def cold_calls(auth: Authenticator, header: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        auth._cache.clear()  # the cold path: what the first request with a credential pays
        start = time.perf_counter()
        await auth.authenticate(header, None)
        out.append(time.perf_counter() - start)
    return out


@contextlib.contextmanager
def scratch_schema(url: str) -> Iterator[str]:
    """A PostgreSQL URL whose connections see only a new schema, dropped afterwards."""
    from sqlalchemy import create_engine, pool
    from sqlalchemy.engine import make_url

    schema = f"bench_auth_{secrets.token_hex(6)}"
    base = make_url(StoreSettings(url=url).database_url(Path()))
    admin = create_engine(base, poolclass=pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        yield base.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


async def run(args: argparse.Namespace, store_url: str | None) -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix="bench-auth-"))
    settings = Settings(data_dir=data_dir, store=StoreSettings(url=store_url) if store_url else StoreSettings())
    store = PolicyStore.open(settings.store, data_dir)
    store.ensure_bootstrap_admin()
    tenant = store.create_tenant("bench")
    _, api_key = store.create_api_key(tenant.id, "bench", "member")
    # IdP role names grant nothing unless mapped (policy.authn.oidc): map "member" to member.
    store.create_oidc_provider("bench-idp", ISSUER, AUDIENCE, tenant_id=tenant.id, role_map={"member": "member"})
    rsa = RSAKey.generate_key(2048)
    idp_http = mock_idp(rsa)

    verifier = OidcVerifier((), http=idp_http)
    real = Authenticator(store, verifier, cache_ttl=settings.auth.cache_ttl_seconds)
    baseline_principal = Principal(tenant_id=tenant.id, tenant_name="bench", subject="bench", kind="api_key",
                                   roles=frozenset({"member"}))
    fixed = FixedPrincipal(store, baseline_principal)
    apps = {
        "baseline": create_app(settings, ModelManager(), store=store, authenticator=fixed),
        "secured": create_app(settings, ModelManager(), store=store, authenticator=real),
    }
    await real.start()  # what the app's lifespan does: load providers, start the pollers
    await fixed.start()
    token = mint(rsa, "alice")
    variants = {
        "baseline": (apps["baseline"], {"authorization": "Bearer none"}),
        "api_key": (apps["secured"], {"authorization": f"Bearer {api_key}"}),
        "jwt": (apps["secured"], {"authorization": f"Bearer {token}"}),
    }
    clients = {
        name: httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench")
        for name, (app, _) in variants.items()
    }
    try:
        for name, (_, headers) in variants.items():  # warm up: imports, caches, the JWKS fetch
            await timed_requests(clients[name], headers, 50)
        samples: dict[str, list[float]] = {name: [] for name in variants}
        per_round: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (_, headers) in variants.items():
                times = await timed_requests(clients[name], headers, args.requests)
                samples[name] += times
                per_round[name].append(statistics.median(times))
        cold = {
            "api_key": await cold_calls(real, f"Bearer {api_key}", args.cold),
            "jwt": await cold_calls(real, f"Bearer {token}", args.cold),
        }
        jwks_fetches = idp_http.fetches["jwks"]  # type: ignore[attr-defined]
    finally:
        for client in clients.values():
            await client.aclose()
        await real.stop()
        await fixed.stop()
        store.close()

    base = samples["baseline"]
    report: dict[str, Any] = {
        "benchmark": "auth",
        "method": "in-process ASGI GET /v1/models; variants alternate per round; added = variant - baseline",
        "store": "postgresql" if args.store_url else "sqlite",
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "jwks_fetches": jwks_fetches,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "per_request_ms": {},
        "added_ms": {},
        "cold_authenticate_ms": {},
    }
    for name, values in samples.items():
        report["per_request_ms"][name] = {
            "p50": pct(values, 50) * 1e3,
            "p99": pct(values, 99) * 1e3,
            "round_medians": [v * 1e3 for v in per_round[name]],
        }
        if name != "baseline":
            report["added_ms"][name] = {
                "p50": (pct(values, 50) - pct(base, 50)) * 1e3,
                "p99": (pct(values, 99) - pct(base, 99)) * 1e3,
            }
    for name, values in cold.items():
        report["cold_authenticate_ms"][name] = {"p50": pct(values, 50) * 1e3, "p99": pct(values, 99) * 1e3}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="requests per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cold", type=int, default=500, help="cold authenticate() calls per credential kind")
    parser.add_argument(
        "--store-url", help="a PostgreSQL URL instead of the default SQLite file (a scratch schema is made and dropped)"
    )
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        store_url = stack.enter_context(scratch_schema(args.store_url)) if args.store_url else None
        report = asyncio.run(run(args, store_url))
    print(__doc__.split("Usage:")[0].strip())
    print()
    print(f"store: {report['store']}; {args.rounds} rounds x {args.requests} requests per variant; "
          f"JWKS fetched {report['jwks_fetches']} time(s)")
    print(f"{'variant':<10} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10}")
    for name, row in report["per_request_ms"].items():
        added = report["added_ms"].get(name)
        extra = f"{added['p50']:>10.3f} {added['p99']:>10.3f}" if added else f"{'-':>10} {'-':>10}"
        print(f"{name:<10} {row['p50']:>8.3f} {row['p99']:>8.3f} {extra}")
    print("cold authenticate() (cache cleared before each call):")
    for name, row in report["cold_authenticate_ms"].items():
        print(f"  {name:<8} p50 {row['p50']:.3f} ms  p99 {row['p99']:.3f} ms")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
