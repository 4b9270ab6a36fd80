#!/usr/bin/env python3
"""The policy store at platform scale: 100,000 tenants and 1,000,000 API keys in PostgreSQL.

Method
------
Two PostgreSQL databases, made fresh on the server of ``--pg`` and dropped at
the end (``--keep`` keeps them, with the sample of keys in a JSON file for
``--reuse``):

* ``<db>``: the *big* store, 100,000 tenants and 1,000,000 API keys (10 tenants
  hold 10,000 keys each, the rest 9 or 10), a ``rate_limit`` policy for every
  tenant and a ``quota`` policy for every tenth, plus one global policy of each;
* ``<db>_empty``: the *empty* store, the same shape at 100 tenants and 1,000 keys
  (one tenant with 100): enough for the measurements, which use about 620 keys of each store.

Each schema is made the way the server makes it (``PolicyStore.open``, which runs
the Alembic migrations) with the bootstrap admin key; the rows are then loaded in
bulk with ``COPY`` (psycopg), then ``VACUUM ANALYZE`` and a ``CHECKPOINT`` run. Keys are real: made
by ``generate_key`` and stored as ``hash_key(pepper, key)`` under the store's own
pepper, so authentication finds them. Role bindings and identity providers are
not generated: no poll and no API key path reads them.

Then, against both stores from the same process, in rounds (``--rounds``), each
measure's samples alternating between the stores one by one (empty, big, big,
empty, ...) so that the shared machine's changing load falls on both alike:

(a) a cold key's authentication: ``Authenticator.authenticate`` (the gateway's
    path: the store lookup by prefix, the HMAC, the tenant) on keys this process
    has not used, each once; and over HTTP, ``GET /v1/models`` with a key that
    the serving replica has not seen, on a live ``inferctl serve`` over each store;
(b) admin list pages over HTTP (the platform admin's key, cached):
    ``GET /admin/v1/tenants?limit=50``, first page and a deep one (an ``after``
    cursor 100 rows before the end), and the same for the keys of the tenant
    with the most keys;
(c) the policy poll: what every replica reads from the store each second when
    nothing changed (``Authenticator.refresh``: ``policy_version``), what it
    reads when the version moved (the identity providers, and the model
    registry for ``gateway/models/sync.py``), and what the first request of a
    tenant reads after a change (its rate limits, quotas and guardrails with
    the global ones, through ``PolicyResolver`` and ``GuardrailResolver``);
(d) a revocation reaching three replicas: three ``inferctl serve`` processes over
    each store; a key is used on replicas 2 and 3 (so its decision is cached
    there), revoked through replica 1's admin API, and replicas 2 and 3 are asked
    every 20 ms until they refuse it (401); timed from the revocation's answer.

The plans of the store's queries on the big store (``EXPLAIN (ANALYZE, BUFFERS)``
of the very statements the store sent) are in the JSON report.

Usage:
    .venv/bin/python benchmarks/bench_store_scale.py [--json out.json] [--keep | --reuse sample.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

from bench_fairness import cpu_model  # noqa: E402 (this folder is on sys.path)

import httpx  # noqa: E402
from sqlalchemy import Engine, create_engine, event, pool, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from inferflux.gateway.auth import Authenticator, call_store  # noqa: E402
from inferflux.policy.authn.apikeys import generate_key, hash_key  # noqa: E402
from inferflux.policy.guardrails.resolver import GuardrailResolver  # noqa: E402
from inferflux.policy.ratelimit.resolver import PolicyResolver  # noqa: E402
from inferflux.policy.rbac import Principal  # noqa: E402
from inferflux.policy.store import PolicyStore, StoreSettings, migrate  # noqa: E402
from inferflux.policy.store.pagination import _cursor as page_cursor  # noqa: E402  (the cursor of a row deep in a list)
from inferflux.policy.store.types import new_id  # noqa: E402

PASSPHRASE = "bench-store-scale passphrase"
START_TIMEOUT = 300.0
REVOCATION_TIMEOUT = 10.0
POLL_EVERY = 0.02


@dataclass(frozen=True)
class Shape:
    tenants: int
    keys: int
    large_tenants: int  # tenants holding ``keys_per_large`` keys each; the others share the rest evenly
    keys_per_large: int

    @classmethod
    def of(cls, tenants: int, keys: int, large_tenants: int) -> Shape:
        """The large tenants hold a tenth of the keys between them."""
        return cls(tenants, keys, large_tenants, keys // (10 * large_tenants))


BIG = Shape.of(tenants=100_000, keys=1_000_000, large_tenants=10)  # 10 tenants of 10,000 keys
EMPTY = Shape.of(tenants=100, keys=1_000, large_tenants=1)  # 1 tenant of 100 keys
SAMPLE = 1_000  # keys whose tokens are kept, in each store
RATE_LIMIT = {"scope": "tenant", "requests_per_minute": 600, "per_key": {"requests_per_minute": 60}}
QUOTA = {"scope": "tenant", "period": "month", "tokens": 50_000_000}


@dataclass
class Generated:
    """What a generated store is, and what the measurements need of it."""

    url: str
    shape: dict[str, int]
    seconds: dict[str, float]
    counts: dict[str, int]
    sample: list[tuple[str, str, str]]  # (tenant id, key id, key), in random order
    largest_tenant: str
    tenant_ids: list[str]  # a random sample, for the per-tenant policy reads


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def summary(values: list[float]) -> dict[str, float]:
    """p50 / p99 / mean in milliseconds, and how many samples."""
    return {"p50": pct(values, 50) * 1e3, "p99": pct(values, 99) * 1e3,
            "mean": statistics.fmean(values) * 1e3, "n": len(values)}  # fmt: skip


    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- databases -----------------------------------------------------------------------------


def database_url(base: str, name: str) -> str:
    return make_url(base).set(drivername="postgresql+psycopg", database=name).render_as_string(hide_password=False)


@contextlib.contextmanager
def server_admin(base: str) -> Iterator[Engine]:
    engine = create_engine(database_url(base, "postgres"), poolclass=pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        yield engine
    finally:
        engine.dispose()


def recreate_database(base: str, name: str) -> str:
    with server_admin(base) as admin, admin.connect() as connection:
        connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
    return database_url(base, name)


def drop_database(base: str, name: str) -> None:
    with server_admin(base) as admin, admin.connect() as connection:
        connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def open_store(url: str, data_dir: Path) -> PolicyStore:
    """The store as ``inferctl serve`` opens it: migrations run (``store.auto_migrate``), key checked."""
    return PolicyStore.open(StoreSettings(url=url, passphrase=PASSPHRASE), data_dir)


# -- generation ------------------------------------------------------------------------------


def copy_rows(engine: Engine, table: str, columns: tuple[str, ...], rows: Iterable[tuple[Any, ...]]) -> int:
    """``COPY table (columns) FROM STDIN`` in one transaction; the number of rows."""
    count = 0
    raw = engine.raw_connection()
    try:
        connection: Any = raw.driver_connection
        with connection.cursor() as cursor, cursor.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
                count += 1
        connection.commit()
    finally:
        raw.close()
    return count


def keys_per_tenant(shape: Shape) -> list[int]:
    """How many keys each tenant holds: the large tenants first, the rest shared out evenly."""
    ordinary = shape.tenants - shape.large_tenants
    each, extra = divmod(shape.keys - shape.large_tenants * shape.keys_per_large, ordinary)
    return [shape.keys_per_large] * shape.large_tenants + [each + (1 if i < extra else 0) for i in range(ordinary)]


def generate(url: str, shape: Shape, admin_key: str, data_dir: Path, rng: random.Random) -> Generated:
    """Make the schema through the store, then load ``shape``'s rows in bulk; timed by phase."""
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    store = open_store(url, data_dir)
    store.ensure_bootstrap_admin(admin_key)
    seconds["schema (migrations) and bootstrap"] = time.perf_counter() - started
    pepper: bytes = store._pepper  # noqa: SLF001 - keys must be hashed exactly as the store hashes them
    engine = store.engine
    now = datetime.now(UTC)
    first = now - timedelta(days=365)
    span = timedelta(days=300) / shape.tenants

    # Tenants, made over 300 days (ids random, so created_at is the list order).
    tenants = [(new_id("ten"), first + span * i + timedelta(seconds=rng.random())) for i in range(shape.tenants)]
    phase = time.perf_counter()
    copied_tenants = copy_rows(
        engine, "tenants", ("id", "name", "display_name", "disabled", "allowed_models", "created_at", "updated_at"),
        ((tid, f"tenant-{i:06d}", f"Tenant {i}", False, None, at, at) for i, (tid, at) in enumerate(tenants)),
    )  # fmt: skip
    seconds["tenants"] = time.perf_counter() - phase

    # API keys, each made after its tenant; SAMPLE of them kept (their tokens) for the measurements.
    counts = keys_per_tenant(shape)
    sampled = set(rng.sample(range(shape.keys), min(SAMPLE, shape.keys)))
    sample: list[tuple[str, str, str]] = []

    def key_rows() -> Iterator[tuple[Any, ...]]:
        position = 0
        for (tenant_id, tenant_at), n in zip(tenants, counts, strict=True):
            room = (now - tenant_at).total_seconds()
            for j in range(n):
                parsed = generate_key()
                key_id = new_id("key")
                at = tenant_at + timedelta(seconds=room * rng.random())
                if position in sampled:
                    sample.append((tenant_id, key_id, parsed.token))
                position += 1
                yield (key_id, tenant_id, parsed.prefix, hash_key(pepper, parsed.token), f"key {j}", "member",
                       None, at, None, None, None, None, "bench")  # fmt: skip

    phase = time.perf_counter()
    copied_keys = copy_rows(
        engine, "api_keys",
        ("id", "tenant_id", "prefix", "key_hash", "name", "role", "allowed_models", "created_at", "expires_at",
         "revoked_at", "last_used_at", "replaced_by", "created_by"),
        key_rows(),
    )  # fmt: skip
    seconds["api keys"] = time.perf_counter() - phase

    # Policies: a rate limit for every tenant, a quota for every tenth, one global of each.
    def policy_rows() -> Iterator[tuple[Any, ...]]:
        owners: list[tuple[str | None, datetime]] = [(None, first), *tenants]
        for i, (tenant_id, at) in enumerate(owners):
            yield (new_id("pol"), tenant_id, "rate_limit", "requests", json.dumps(RATE_LIMIT), True, at, at)
            if i % 10 == 0:
                yield (new_id("pol"), tenant_id, "quota", "monthly tokens", json.dumps(QUOTA), True, at, at)

    phase = time.perf_counter()
    copied_policies = copy_rows(
        engine, "policies", ("id", "tenant_id", "kind", "name", "spec", "enabled", "created_at", "updated_at"),
        policy_rows(),
    )  # fmt: skip
    seconds["policies"] = time.perf_counter() - phase
    store.close()

    phase = time.perf_counter()
    vacuum_analyze(url)
    seconds["vacuum analyze, checkpoint"] = time.perf_counter() - phase
    seconds["total"] = time.perf_counter() - started
    rng.shuffle(sample)
    return Generated(
        url=url,
        shape=asdict(shape),
        seconds=seconds,
        counts={"tenants": copied_tenants + 1, "api_keys": copied_keys + 1, "policies": copied_policies},
        sample=sample,
        largest_tenant=tenants[0][0],
        tenant_ids=[tid for tid, _ in rng.sample(tenants, min(200, len(tenants)))],
    )  # the +1s: the platform tenant and its bootstrap admin key


def vacuum_analyze(url: str) -> None:
    """Statistics and visibility for the loaded tables, and a checkpoint, so that writing out the load's
    dirty pages is over before anything is timed."""
    engine = create_engine(url, poolclass=pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            for table in ("tenants", "api_keys", "policies"):
                connection.exec_driver_sql(f"VACUUM (ANALYZE) {table}")
            connection.exec_driver_sql("CHECKPOINT")
    finally:
        engine.dispose()


def reuse(saved: dict[str, Any], url: str, data_dir: Path) -> Generated:
    """A store kept by an earlier ``--keep`` run: migrated to this checkout's head (timed), its sample unrevoked."""
    generated = Generated(**{**saved, "url": url, "sample": [tuple(k) for k in saved["sample"]]})
    started = time.perf_counter()
    before = migrate.current(url)
    open_store(url, data_dir).close()
    generated.seconds = {f"migrate {before} -> {migrate.current(url)}": time.perf_counter() - started}
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE api_keys SET revoked_at = NULL WHERE revoked_at IS NOT NULL"))
    finally:
        engine.dispose()
    vacuum_analyze(url)
    return generated


# -- in-process measurements --------------------------------------------------------------------


def principal(tenant_id: str) -> Principal:
    return Principal(tenant_id=tenant_id, tenant_name="bench", subject="key:bench", kind="api_key",
                     roles=frozenset({"member"}))  # fmt: skip


class InProcess:
    """One store opened as the gateway opens it, and the gateway's readers over it."""

    def __init__(self, generated: Generated, data_dir: Path) -> None:
        self.generated = generated
        self.store = open_store(generated.url, data_dir)
        self.auth = Authenticator(self.store)
        self.limits = PolicyResolver(self.store)
        self.guardrails = GuardrailResolver(self.store)

    async def cold_key(self, key: tuple[str, str, str]) -> float:
        tenant_id, _, token = key
        start = time.perf_counter()
        found = await self.auth.authenticate(f"Bearer {token}", None)
        elapsed = time.perf_counter() - start
        if found.tenant_id != tenant_id:
            raise SystemExit(f"key of {tenant_id} authenticated as {found.tenant_id}")
        return elapsed

    async def steady_poll(self) -> float:
        start = time.perf_counter()
        if await self.auth.refresh():
            raise SystemExit("the store changed during the benchmark")
        return time.perf_counter() - start

    async def changed_poll(self) -> float:
        """What a replica reads when ``policy_version`` moved: identity providers, the model registry."""
        start = time.perf_counter()
        await self.auth.refresh(force=True)
        await call_store(self.store.list_served_models)
        return time.perf_counter() - start

    async def tenant_policies(self, tenant_id: str) -> float:
        """What a tenant's first request after a change reads: its limits and guardrails, with the global ones."""
        await self.limits.refresh(force=True)
        self.guardrails.invalidate()
        start = time.perf_counter()
        limits = await self.limits.limits_for(principal(tenant_id))
        await self.guardrails.resolve(tenant_id)
        elapsed = time.perf_counter() - start
        if limits is None:
            raise SystemExit(f"no limits for {tenant_id}")
        return elapsed

    def close(self) -> None:
        self.store.close()


def explain(store: PolicyStore, call: Callable[[], Any]) -> list[dict[str, Any]]:
    """``EXPLAIN (ANALYZE, BUFFERS)`` of each SELECT that ``call`` sent to the store, with its parameters."""
    sent: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any, _many: bool) -> None:
        if re.match(r"\s*SELECT\b.*\bFROM\b", statement, re.IGNORECASE | re.DOTALL):
            sent.append((statement, parameters))

    event.listen(store.engine, "before_cursor_execute", capture)
    try:
        call()
    finally:
        event.remove(store.engine, "before_cursor_execute", capture)
    plans = []
    with store.engine.connect() as connection:
        for statement, parameters in sent:
            lines = connection.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + statement, parameters).scalars().all()
            plans.append({"sql": " ".join(statement.split()), "plan": list(lines)})
    return plans


def deep_cursor(store: PolicyStore, table: str, where: str, params: dict[str, Any], from_end: int) -> str:
    """The ``after`` cursor of the row ``from_end`` rows before the end of a list (its page order), or of
    its first row if the list is shorter."""
    count = text(f"SELECT count(*) FROM {table} {where}")
    query = text(f"SELECT created_at, id FROM {table} {where} ORDER BY created_at DESC, id DESC OFFSET :n LIMIT 1")
    with store.engine.connect() as connection:
        n = min(from_end, connection.execute(count, params).scalar_one() - 1)
        at, row_id = connection.execute(query, {**params, "n": n}).one()
    return page_cursor(at, row_id)


# -- replicas ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Replica:
    """``inferctl serve`` on a loopback port over a store, its data in a temporary directory."""

    def __init__(self, name: str, url: str, admin_key: str, workdir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data_dir = workdir / name
        self.log_path = workdir / f"{name}.log"
        env = {**os.environ, "INFERFLUX_STORE_URL": url, "INFERFLUX_STORE_PASSPHRASE": PASSPHRASE,
               "INFERFLUX_BOOTSTRAP_ADMIN_KEY": admin_key}  # fmt: skip
        argv = [sys.executable, "-m", "inferflux.gateway.cli", "serve", "--port", str(self.port), "--data-dir", str(data_dir),
                "--dtype", "float32", "--kv-cache-bytes", "32MiB", "--log-level", "warning"]  # fmt: skip
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)  # fmt: skip

    def wait_ready(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.name} not ready in {START_TIMEOUT} s:\n{self.output()}")
            time.sleep(0.5)

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


class Fleet:
    """Three replicas over one store, and HTTP clients for them."""

    def __init__(self, label: str, generated: Generated, admin_key: str, workdir: Path) -> None:
        self.label = label
        self.generated = generated
        self.replicas = [Replica(f"{label}-{i}", generated.url, admin_key, workdir) for i in (1, 2, 3)]
        self.admin = {"authorization": f"Bearer {admin_key}"}
        self.clients = [httpx.Client(base_url=r.url, timeout=30) for r in self.replicas]

    def wait_ready(self, deadline: float) -> None:
        for replica in self.replicas:
            replica.wait_ready(deadline)

    def timed_get(self, path: str, headers: dict[str, str], expect: int = 200, replica: int = 0) -> float:
        start = time.perf_counter()
        response = self.clients[replica].get(path, headers=headers)
        elapsed = time.perf_counter() - start
        if response.status_code != expect:
            raise SystemExit(f"{self.label}: GET {path} answered {response.status_code}: {response.text[:300]}")
        return elapsed

    def revoke_and_wait(self, tenant_id: str, key_id: str, token: str) -> dict[str, float]:
        """Revoke through replica 1 a key cached on replicas 2 and 3; seconds until each refuses it."""
        key = {"authorization": f"Bearer {token}"}
        for i in (1, 2):
            self.timed_get("/v1/models", key, replica=i)  # cached there now
        sent = time.monotonic()
        response = self.clients[0].post(f"/admin/v1/tenants/{tenant_id}/keys/{key_id}/revoke", headers=self.admin)
        answered = time.monotonic()
        if response.status_code != 200:
            raise SystemExit(f"{self.label}: revoke answered {response.status_code}: {response.text[:300]}")
        took = {"revoke call": answered - sent}
        self.timed_get("/v1/models", key, expect=401, replica=0)  # the replica that revoked: at once
        pending = {1, 2}
        while pending:
            for i in sorted(pending):
                if self.clients[i].get("/v1/models", headers=key).status_code == 401:
                    took[f"replica {i + 1}"] = time.monotonic() - answered
                    pending.discard(i)
            if pending and time.monotonic() - answered > REVOCATION_TIMEOUT:
                raise SystemExit(f"{self.label}: revoked key still accepted after {REVOCATION_TIMEOUT} s")
            time.sleep(POLL_EVERY)
        return took

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        for replica in self.replicas:
            replica.stop()


# -- the run -------------------------------------------------------------------------------------

STORES = ("empty", "big")


def alternate(i: int) -> tuple[str, ...]:
    """The stores in the order the ``i``-th sample of a measure takes them: sample by sample, each store
    goes first every other time, so that the shared machine's changing load falls on both alike."""
    return STORES if i % 2 == 0 else STORES[::-1]


class Samples:
    """Timings in seconds by store and measure, kept by round, so each round's median can be reported."""

    def __init__(self) -> None:
        self.rounds: dict[str, dict[str, list[list[float]]]] = {name: {} for name in STORES}

    def add_round(self, what: str, values: dict[str, list[float]]) -> None:
        """One round of ``what``: its timings on each store."""
        for store, timings in values.items():
            self.rounds[store].setdefault(what, []).append(timings)

    def compare(self) -> dict[str, Any]:
        """Each measure's p50/p99 (ms) on both stores, big / empty, and the median of every round."""
        out = {}
        for what in self.rounds["big"]:
            row: dict[str, Any] = {}
            for name in STORES:
                rounds = self.rounds[name][what]
                row[name] = {**summary([v for r in rounds for v in r]),
                             "round_medians": [round(statistics.median(r) * 1e3, 3) for r in rounds]}  # fmt: skip
            row["ratio p50"] = row["big"]["p50"] / row["empty"]["p50"]
            row["ratio p99"] = row["big"]["p99"] / row["empty"]["p99"]
            out[what] = row
        return out


def take(pool_: dict[str, list[tuple[str, str, str]]], name: str, n: int) -> list[tuple[str, str, str]]:
    """The next ``n`` unused sample keys of store ``name``."""
    taken, pool_[name] = pool_[name][:n], pool_[name][n:]
    if len(taken) < n:
        raise SystemExit(f"the {name} store's sample of keys ran out; lower --cold or --revocations")
    return taken


async def in_process(args: argparse.Namespace, stores: dict[str, Generated], unused: dict[str, list[Any]],
                     data_dir: Path) -> dict[str, Any]:  # fmt: skip
    readers = {name: InProcess(stores[name], data_dir / f"reader-{name}") for name in STORES}
    samples = Samples()
    try:
        for name, reader in readers.items():  # warm up: the pool's connections, imports, the first refresh
            await reader.auth.refresh(force=True)
            for key in take(unused, name, 10):
                await reader.cold_key(key)
        per_round = max(1, args.cold // args.rounds)
        for _ in range(args.rounds):
            keys = {name: take(unused, name, per_round) for name in STORES}
            tenants = {name: random.choices(stores[name].tenant_ids, k=args.polls) for name in STORES}
            for what, n, measure in (
                ("cold key authentication", per_round, lambda name, i: readers[name].cold_key(keys[name][i])),
                ("poll, nothing changed", args.polls, lambda name, i: readers[name].steady_poll()),
                ("poll after a change", args.polls, lambda name, i: readers[name].changed_poll()),
                ("a tenant's policies after a change", args.polls,
                 lambda name, i: readers[name].tenant_policies(tenants[name][i])),
            ):  # fmt: skip
                values: dict[str, list[float]] = {name: [] for name in STORES}
                for i in range(n):
                    for name in alternate(i):
                        values[name].append(await measure(name, i))
                samples.add_round(what, values)
        plans = query_plans(readers["big"], unused["big"][0], args.explain_from_end)
    finally:
        for reader in readers.values():
            reader.close()
    return {"samples": samples, "plans": plans}


def query_plans(reader: InProcess, key: tuple[str, str, str], from_end: int) -> dict[str, Any]:
    store, largest = reader.store, reader.generated.largest_tenant
    tenants_after = deep_cursor(store, "tenants", "", {}, from_end)
    keys_after = deep_cursor(store, "api_keys", "WHERE tenant_id = :t", {"t": largest}, from_end)
    tenant = reader.generated.tenant_ids[0]
    return {
        "find_api_key": explain(store, lambda: store.find_api_key(key[2])),
        "get_tenant": explain(store, lambda: store.get_tenant(key[0])),
        "list_tenants first page": explain(store, lambda: store.list_tenants(limit=50)),
        "list_tenants deep page": explain(store, lambda: store.list_tenants(limit=50, after=tenants_after)),
        "list_api_keys first page (largest tenant)": explain(store, lambda: store.list_api_keys(largest, limit=50)),
        "list_api_keys deep page (largest tenant)": explain(
            store, lambda: store.list_api_keys(largest, limit=50, after=keys_after)
        ),
        "policy_version": explain(store, store.policy_version),
        "list_enabled_oidc_providers": explain(store, store.list_enabled_oidc_providers),
        "list_served_models": explain(store, store.list_served_models),
        "list_policies (a tenant's rate limits with the global ones)": explain(
            store, lambda: store.list_policies(tenant, 200, kind="rate_limit", include_global=True)
        ),
    }


def over_http(args: argparse.Namespace, stores: dict[str, Generated], unused: dict[str, list[Any]],
              admin_key: str, workdir: Path) -> dict[str, Any]:  # fmt: skip
    log("starting three inferctl serve replicas over each store")
    fleets = {name: Fleet(name, stores[name], admin_key, workdir) for name in STORES}
    samples = Samples()
    revocations: dict[str, list[dict[str, float]]] = {name: [] for name in STORES}
    try:
        deadline = time.monotonic() + START_TIMEOUT
        for fleet in fleets.values():
            fleet.wait_ready(deadline)
        log("replicas ready")
        pages: dict[str, dict[str, str]] = {}
        for name, fleet in fleets.items():
            with contextlib.closing(open_store(stores[name].url, workdir / f"cursor-{name}")) as store:
                largest = stores[name].largest_tenant
                keys_page = f"/admin/v1/tenants/{largest}/keys?limit=50"
                pages[name] = {
                    "tenants, first page": "/admin/v1/tenants?limit=50",
                    "tenants, deep page": "/admin/v1/tenants?limit=50&after="
                    + deep_cursor(store, "tenants", "", {}, args.explain_from_end),
                    "a tenant's keys, first page": keys_page,
                    "a tenant's keys, deep page": keys_page + "&after="
                    + deep_cursor(store, "api_keys", "WHERE tenant_id = :t", {"t": largest}, args.explain_from_end),
                }
            for path in pages[name].values():  # warm up: connections, the admin key's decision
                fleet.timed_get(path, fleet.admin)
            key = {"authorization": f"Bearer {take(unused, name, 1)[0][2]}"}
            fleet.timed_get("/v1/models", key)
        per_round = max(1, args.cold // args.rounds)
        for _ in range(args.rounds):
            keys = {name: take(unused, name, per_round) for name in STORES}

            def cold(name: str, i: int) -> float:
                return fleets[name].timed_get("/v1/models", {"authorization": f"Bearer {keys[name][i][2]}"})

            def page(what: str) -> Callable[[str, int], float]:
                return lambda name, _: fleets[name].timed_get(pages[name][what], fleets[name].admin)

            measures = [("cold key, GET /v1/models", per_round, cold), *((w, args.pages, page(w)) for w in pages["big"])]
            for what, n, measure in measures:
                values: dict[str, list[float]] = {name: [] for name in STORES}
                for i in range(n):
                    for name in alternate(i):
                        values[name].append(measure(name, i))
                samples.add_round(what, values)
        log("revocations")
        for round_ in range(args.revocations):
            for name in alternate(round_):
                fleet = fleets[name]
                tenant_id, key_id, token = take(unused, name, 1)[0]
                revocations[name].append(fleet.revoke_and_wait(tenant_id, key_id, token))
    finally:
        for fleet in fleets.values():
            fleet.stop()
    return {"samples": samples, "revocations": revocations}


def revocation_summary(revocations: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    out = {}
    for name, trials in revocations.items():
        slowest = [max(t["replica 2"], t["replica 3"]) for t in trials]
        out[name] = {"trials": trials, "slowest replica, s": {"p50": pct(slowest, 50), "max": max(slowest)},
                     "revoke call, s": {"p50": pct([t["revoke call"] for t in trials], 50)}}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/postgres",
                        help="the PostgreSQL server (its database is ignored: <db> and <db>_empty are made there)")
    parser.add_argument("--db", default="inferflux_scale", help="name of the big store's database")
    parser.add_argument("--keep", action="store_true", help="keep both databases, and write the sample of keys "
                        "to <db>-sample.json beside --json (for --reuse)")
    parser.add_argument("--reuse", type=Path, metavar="SAMPLE_JSON",
                        help="use the databases an earlier --keep run left (migrated to this checkout's head)")
    parser.add_argument("--tenants", type=int, default=BIG.tenants)
    parser.add_argument("--keys", type=int, default=BIG.keys)
    parser.add_argument("--rounds", type=int, default=4, help="rounds (each one's median is reported)")
    parser.add_argument("--cold", type=int, default=300, help="cold keys per store, in-process and over HTTP each")
    parser.add_argument("--polls", type=int, default=40, help="polls of each kind per store per round")
    parser.add_argument("--pages", type=int, default=40, help="requests of each admin page per store per round")
    parser.add_argument("--revocations", type=int, default=8, help="revocations per store")
    parser.add_argument("--explain-from-end", type=int, default=100, help="deep pages start this many rows before the end")
    parser.add_argument("--no-replicas", action="store_true", help="skip (a), (b) over HTTP and (d)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args()

    rng = random.Random(20)
    admin_key = generate_key().token
    names = {"big": args.db, "empty": f"{args.db}_empty"}
    shapes = {"big": Shape.of(args.tenants, args.keys, BIG.large_tenants), "empty": EMPTY}
    workdir = Path(tempfile.mkdtemp(prefix="bench-store-scale-"))
    stores: dict[str, Generated] = {}
    sample_file = args.reuse or (args.json or Path(f"{args.db}.json")).with_name(f"{args.db}-sample.json")
    try:
        if args.reuse:
            saved = json.loads(args.reuse.read_text())
            admin_key = saved["admin_key"]
            for name in STORES:
                log(f"reusing {names[name]}")
                stores[name] = reuse(saved[name], database_url(args.pg, names[name]), workdir / f"open-{name}")
        else:
            for name in STORES:
                log(f"generating the {name} store in database {names[name]}: {shapes[name]}")
                url = recreate_database(args.pg, names[name])
                stores[name] = generate(url, shapes[name], admin_key, workdir / f"gen-{name}", rng)
                log(f"  {stores[name].counts} in {stores[name].seconds['total']:.1f} s: {stores[name].seconds}")
            if args.keep:
                sample_file.write_text(json.dumps(
                    {"admin_key": admin_key, **{name: asdict(g) for name, g in stores.items()}}, indent=1
                ))  # fmt: skip
        unused = {name: list(stores[name].sample) for name in STORES}
        log("in-process: cold authentication, polls, query plans")
        inproc = asyncio.run(in_process(args, stores, unused, workdir))
        http = None if args.no_replicas else over_http(args, stores, unused, admin_key, workdir)
    finally:
        if not args.keep and not args.reuse:
            for name in STORES:
                drop_database(args.pg, names[name])
    report = build_report(args, stores, inproc, http)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")


def build_report(args: argparse.Namespace, stores: dict[str, Generated], inproc: dict[str, Any],
                 http: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    with server_admin(args.pg) as admin, admin.connect() as connection:
        pg_version = connection.exec_driver_sql("SHOW server_version").scalar()
        shared_buffers = connection.exec_driver_sql("SHOW shared_buffers").scalar()
    return {
        "benchmark": "store_scale",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "method": __doc__.split("Usage:")[0].strip() if __doc__ else "",
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "postgresql": pg_version, "shared_buffers": shared_buffers,
                    "load_average": os.getloadavg()},  # fmt: skip
        "schema_revision": migrate.current(stores["big"].url) if args.keep or args.reuse else migrate.head(),
        "generation": {name: {"shape": g.shape, "counts": g.counts, "seconds": g.seconds} for name, g in stores.items()},
        "rounds": args.rounds,
        "in_process": inproc["samples"].compare(),
        "http": http["samples"].compare() if http else None,
        "revocation": revocation_summary(http["revocations"]) if http else None,
        "plans_big_store": inproc["plans"],
    }


def print_report(report: dict[str, Any]) -> None:
    print(__doc__.split("Usage:")[0].strip() if __doc__ else "")
    print()
    print(f"CPU: {report['machine']['cpu']}; PostgreSQL {report['machine']['postgresql']}; "
          f"schema revision {report['schema_revision']}")  # fmt: skip
    for name, g in report["generation"].items():
        print(f"{name}: {g['counts']}; " + ", ".join(f"{k} {v:.1f} s" for k, v in g["seconds"].items()))
    for part in ("in_process", "http"):
        if not report[part]:
            continue
        print(f"\n{part.replace('_', '-')}: {'measure':<40} {'empty p50':>9} {'p99':>7} {'big p50':>8} {'p99':>7} "
              f"{'x p50':>6} {'x p99':>6}")  # fmt: skip
        for what, row in report[part].items():
            e, b = row["empty"], row["big"]
            print(f"{'':<{len(part) + 2}}{what:<40} {e['p50']:>9.2f} {e['p99']:>7.2f} {b['p50']:>8.2f} "
                  f"{b['p99']:>7.2f} {row['ratio p50']:>6.2f} {row['ratio p99']:>6.2f}")  # fmt: skip
    if report["revocation"]:
        print("\nrevocation through replica 1, until replicas 2 and 3 refuse the key (seconds after the answer):")
        for name, row in report["revocation"].items():
            slowest = row["slowest replica, s"]
            print(f"  {name:<6} slowest replica p50 {slowest['p50']:.2f} s, max {slowest['max']:.2f} s "
                  f"over {len(row['trials'])} revocations")  # fmt: skip


if __name__ == "__main__":
    main()
