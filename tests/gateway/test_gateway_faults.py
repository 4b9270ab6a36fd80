"""Degraded modes under real faults: the policy store down, Redis down, the audit disk full.

Each fault is real and private to the test: a throwaway PostgreSQL cluster
(``pg_cluster``) stopped and started, a redis-server of its own shut down, an
audit spool on a tmpfs of 1 MiB filled up. The gateway serves over a loopback
socket. What is asserted is what a client and an operator see: warm keys keep
generating within ``store.stale_seconds`` and nothing else does, every answer
that looks complete is on the audit trail, and ``/readyz`` says what is true.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_helpers import bearer, error_of
from pg_cluster import ThrowawayPostgres, server_bin, wait_until
from servers import free_loopback_socket, start_uvicorn, stop_uvicorn
from services import service_unavailable

# Every test serves the default model; two also run a PostgreSQL or Redis of their own (the tiers: tests/conftest.py).
pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"


def chat(url: str, key: str, text: str = "Hi", *, max_tokens: int = 1, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer(key), timeout=60)


def stream_chat(url: str, key: str, *, max_tokens: int = 4) -> tuple[int, list[str]]:
    """(status, the stream's data lines) of a streamed chat."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count"}], "max_tokens": max_tokens,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=bearer(key), timeout=60) as response:
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
        return response.status_code, lines


def serving(served_model: Any, policy_store: Any, **settings: Any) -> Any:
    """An app serving the session's model from ``store`` with ``settings`` (any key, ``store`` included)."""
    from inferflux.gateway.app import create_app
    from inferflux.gateway.models.served import ModelManager
    from inferflux.gateway.settings import Settings

    manager = ModelManager(expected=[served_model.name])
    manager.add(served_model)
    return create_app(Settings(**settings), manager, store=policy_store, owns_models=False)


def assert_503_retry(response: httpx.Response, code: str) -> None:
    assert response.status_code == 503, response.text
    assert error_of(response)["code"] == code, response.text
    assert int(response.headers["retry-after"]) >= 1


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def readiness(url: str) -> tuple[int, list[str]]:
    response = httpx.get(f"{url}/readyz", timeout=10)
    return response.status_code, response.json().get("reasons", [])


# -- the policy store -------------------------------------------------------------


@pytest.fixture
def throwaway_pg() -> Iterator[ThrowawayPostgres]:
    if server_bin() is None:
        service_unavailable("no PostgreSQL server binaries (/usr/lib/postgresql/*/bin)", "PostgreSQL outage")
    pg = ThrowawayPostgres()
    try:
        pg.start()
        yield pg
    finally:
        pg.remove()


@pytest.mark.service
def test_store_outage_serves_cached_decisions_for_the_stale_window_only(
    throwaway_pg: ThrowawayPostgres, served_model: Any, tmp_path: Path
) -> None:
    from inferflux.policy.store import PolicyStore, StoreSettings

    stale_seconds = 8.0
    store_settings = {"url": throwaway_pg.url, "stale_seconds": stale_seconds}
    store = PolicyStore.open(StoreSettings(**store_settings), tmp_path)
    admin = store.ensure_bootstrap_admin()
    tenant = store.create_tenant("acme")
    _, warm = store.create_api_key(tenant.id, "warm", "member")
    _, cold = store.create_api_key(tenant.id, "cold", "member")
    store.create_policy(tenant.id, "guardrail", "words", {"blocklist": [{"id": "w1", "literal": "bluebird"}]})
    store.create_policy(tenant.id, "rate_limit", "rl", {"scope": "tenant", "requests_per_minute": 1000})
    # Cached decisions live 0.5 s: the outage below outlasts them many times over.
    app = serving(served_model, store, data_dir=tmp_path / "app", store=store_settings,
                  auth={"cache_ttl_seconds": 0.5, "revocation_poll_seconds": 0.2})  # fmt: skip
    server, thread, sock, url = start_uvicorn(app)
    try:
        assert chat(url, warm).status_code == 200
        assert error_of(chat(url, warm, "a bluebird"))["code"] == "content_filter"

        throwaway_pg.stop()
        down_at = time.monotonic()
        time.sleep(1.0)  # the cache entries have expired; the pollers have seen the outage
        assert_503_retry(chat(url, cold), "policy_store_unavailable")  # never seen: nothing to serve
        created = httpx.post(f"{url}/admin/v1/tenants", json={"name": "new"}, headers=bearer(str(admin)), timeout=30)
        assert_503_retry(created, "policy_store_unavailable")
        assert readiness(url) == (200, [])
        assert metric(url, "inferflux_policy_serving_stale") == 1.0
        assert metric(url, "inferflux_policy_snapshot_age_seconds") >= 1.0
        # Warm keys generate, with their limits and guardrails, while the window lasts
        # (a margin for a loaded machine: the window counts from the last good read).
        statuses = []
        while time.monotonic() < down_at + stale_seconds - 3 and len(statuses) < 4:
            statuses.append(chat(url, warm).status_code)
        assert statuses and statuses == [200] * len(statuses), statuses
        assert error_of(chat(url, warm, "a bluebird"))["code"] == "content_filter"  # guardrails from the snapshot

        time.sleep(max(0.0, down_at + stale_seconds + 0.5 - time.monotonic()))
        assert_503_retry(chat(url, warm), "policy_store_unavailable")  # the window is over
        status, reasons = readiness(url)
        assert status == 503 and any("policy store" in r for r in reasons), reasons

        throwaway_pg.start()
        assert wait_until(lambda: readiness(url)[0] == 200, timeout=10)
        assert chat(url, warm).status_code == 200
        assert metric(url, "inferflux_policy_serving_stale") == 0.0
    finally:
        stop_uvicorn(server, thread, sock)
        store.close()


# -- Redis (rate-limit counters) ----------------------------------------------------


def start_redis(port: int, where: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(where)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    import redis

    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    assert wait_until(lambda: _pings(client), timeout=10), "redis-server did not start"
    return proc


def _pings(client: Any) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


@pytest.mark.service
def test_redis_outage_with_fail_closed_limits_is_not_ready(served_model: Any, tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        service_unavailable("no redis-server binary", "Redis outage")
    from inferflux.policy.store import PolicyStore, StoreSettings

    sock = free_loopback_socket()
    port = sock.getsockname()[1]
    sock.close()
    redis_proc = start_redis(port, tmp_path)
    store = PolicyStore.open(StoreSettings(), tmp_path)
    store.ensure_bootstrap_admin()
    tenant = store.create_tenant("acme")
    _, key = store.create_api_key(tenant.id, "app", "member")
    store.create_policy(tenant.id, "rate_limit", "rl", {"scope": "tenant", "requests_per_minute": 1000})
    app = serving(served_model, store, data_dir=tmp_path / "app",
                  ratelimit={"backend": "redis", "redis_url": f"redis://127.0.0.1:{port}/0"})  # fmt: skip
    server, thread, http_sock, url = start_uvicorn(app)
    try:
        assert readiness(url) == (200, []) and chat(url, key).status_code == 200
        redis_proc.terminate()
        redis_proc.wait(timeout=10)
        status, reasons = readiness(url)
        assert status == 503 and any("rate-limit backend" in r for r in reasons), reasons
        assert_503_retry(chat(url, key), "rate_limiter_unavailable")
        redis_proc = start_redis(port, tmp_path)
        assert wait_until(lambda: readiness(url)[0] == 200, timeout=10)
        assert wait_until(lambda: chat(url, key).status_code == 200, timeout=10)
    finally:
        stop_uvicorn(server, thread, http_sock)
        store.close()
        redis_proc.terminate()
        redis_proc.wait(timeout=10)


# -- the audit spool's disk -------------------------------------------------------


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 1 MiB tmpfs: a disk the test can fill to the last byte."""
    where = Path(tempfile.mkdtemp(prefix="inferflux-tmpfs-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        shutil.rmtree(where, ignore_errors=True)


def fill(disk: Path, leave: int) -> Path:
    """Write a filler file until ``leave`` bytes are free (0: until ENOSPC)."""
    filler = disk / f"filler-{time.monotonic_ns()}"
    with open(filler, "wb") as f:
        try:
            while True:
                stat = os.statvfs(disk)
                free = stat.f_bavail * stat.f_frsize - leave
                if free <= 0:
                    break
                f.write(b"\0" * min(free, 64 * 1024))
                f.flush()
        except OSError:
            pass
    return filler


def spooled(spool: Path) -> list[dict[str, Any]]:
    events = []
    for segment in sorted((spool / "segments").glob("*.jsonl")):
        for line in segment.read_bytes().splitlines():
            events.append(json.loads(line)["event"])
    return events


def test_no_answer_leaves_without_its_audit_event_when_the_spool_disk_fills(
    small_disk: Path, served_model: Any, tmp_path: Path
) -> None:
    from inferflux.policy.store import PolicyStore, StoreSettings

    store = PolicyStore.open(StoreSettings(), tmp_path)
    admin = str(store.ensure_bootstrap_admin())
    tenant = store.create_tenant("acme")
    _, key = store.create_api_key(tenant.id, "app", "member")
    spool = small_disk / "audit"
    app = serving(served_model, store, data_dir=tmp_path / "app",
                  audit={"spool_dir": str(spool), "min_free_bytes": 256 * 1024})  # fmt: skip
    server, thread, sock, url = start_uvicorn(app)
    complete: list[str] = []  # request ids of streams that ended with a bare [DONE]

    def streamed(max_tokens: int = 4) -> tuple[int, list[str]]:
        status, lines = stream_chat_with_id(url, key, complete, max_tokens=max_tokens)
        return status, lines

    try:
        assert streamed()[0] == 200 and readiness(url) == (200, [])

        # Below the watermark: new work is refused while its events would still fit.
        low = fill(small_disk, leave=128 * 1024)
        time.sleep(0.3)  # the spool reads the free space at most every 0.25 s
        status, reasons = readiness(url)
        assert status == 503 and any("disk_low" in r for r in reasons), reasons
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 2}
        refused = httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer(key), timeout=30)
        assert_503_retry(refused, "audit_unavailable")
        assert_503_retry(chat(url, key), "audit_unavailable")
        keys_before = len(store.list_api_keys(tenant.id).items)
        made = httpx.post(f"{url}/admin/v1/tenants/{tenant.id}/keys", json={"name": "late", "role": "member"},
                          headers=bearer(admin), timeout=30)  # fmt: skip
        assert_503_retry(made, "audit_unavailable")
        assert len(store.list_api_keys(tenant.id).items) == keys_before  # refused before it was made
        assert metric(url, "inferflux_audit_spool_healthy") == 0.0
        assert any(e.get("action") == "audit.disk_low" for e in spooled(spool))  # the alert is on the trail

        # Back above it: served again.
        low.unlink()
        time.sleep(0.3)
        assert readiness(url) == (200, [])

        # A stream running when the disk fills up: it ends with [DONE] only if its event still fit.
        ending = stream_started(url, key, lambda: fill(small_disk, leave=0))
        full = sorted(small_disk.glob("filler-*"))[-1]
        if ending[-1:] == ["[DONE]"] and not any('"error"' in x for x in ending):
            complete.append(ending[0])
        time.sleep(0.3)
        assert streamed()[0] == 503  # the disk is full: no new stream starts
        full.unlink()
        time.sleep(2.5)  # the spool's failure hold
        assert wait_until(lambda: readiness(url)[0] == 200, timeout=5)
        assert streamed()[0] == 200

        # A stream whose event cannot be written at its end (here the spool closes under it)
        # ends with an error event, never a bare [DONE].
        ending = stream_started(url, key, app.state.audit_trail.spool.close)
        assert ending[-1] == "[DONE]" and json.loads(ending[-2])["error"]["code"] == "audit_unavailable", ending[-3:]
    finally:
        stop_uvicorn(server, thread, sock)
        store.close()
    recorded = {e.get("request_id") for e in spooled(spool)}
    assert len(complete) >= 2 and set(complete) <= recorded, (complete, recorded)


def stream_started(url: str, key: str, then: Any) -> list[str]:
    """A long stream; ``then()`` runs once its first chunk is in. Returns [its request id, *its data lines]."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to fifty"}], "max_tokens": 48,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=bearer(key), timeout=60) as response:
        assert response.status_code == 200
        lines = (line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))
        first = next(lines)
        then()
        return [response.headers["x-request-id"], first, *lines]


def stream_chat_with_id(url: str, key: str, complete: list[str], *, max_tokens: int) -> tuple[int, list[str]]:
    """A streamed chat; its request id goes into ``complete`` if it ended with a bare [DONE]."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count"}], "max_tokens": max_tokens,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=bearer(key), timeout=60) as response:
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    if response.status_code == 200 and lines[-1:] == ["[DONE]"] and not any('"error"' in x for x in lines):
        complete.append(response.headers["x-request-id"])
    return response.status_code, lines


# -- a drain on SIGTERM -----------------------------------------------------------


@pytest.mark.serial  # the exit is timed against the grace period
def test_sigterm_drains_ready_first_then_ends_streams_cleanly(tmp_path: Path) -> None:
    import signal
    import threading

    from inferflux.policy.authn.apikeys import generate_key
    from replica import Replica

    grace = 3.0
    key = generate_key().token
    config = tmp_path / "config.yaml"
    config.write_text(f"server:\n  shutdown_grace_seconds: {grace}\n")
    env = {**os.environ, "INFERFLUX_BOOTSTRAP_ADMIN_KEY": key}
    env.pop("INFERFLUX_STORE_URL", None)
    server = Replica("drained", tmp_path / "data", env, tmp_path / "serve.log",
                     ["--config", str(config), "--kv-cache-bytes", "64MiB"])  # room for two long streams
    streams: list[list[str]] = [[], []]
    ids: list[str] = ["", ""]
    started = threading.Barrier(3)

    def long_stream(slot: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a very long story"}],
                "max_tokens": 600, "stream": True, "temperature": 0}  # fmt: skip
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=bearer(key),
                          timeout=60) as response:  # fmt: skip
            assert response.status_code == 200, response.read()
            ids[slot] = response.headers["x-request-id"]
            lines = (line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))
            streams[slot].append(next(lines))
            started.wait(timeout=60)
            streams[slot].extend(lines)

    try:
        server.wait_ready()
        workers = [threading.Thread(target=long_stream, args=(i,), daemon=True) for i in range(2)]
        for worker in workers:
            worker.start()
        started.wait(timeout=120)  # both streams are producing tokens
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        status, reasons = readiness(server.url)
        assert status == 503 and "the server is shutting down" in reasons, reasons
        assert_503_retry(chat(server.url, key), "server_shutting_down")  # new work: refused, not queued
        for worker in workers:
            worker.join(timeout=grace + 15)
        code = server.proc.wait(timeout=grace + 15)
        took = time.monotonic() - signalled
    finally:
        server.stop()
    log = server.output()
    assert code in (0, -signal.SIGTERM), log
    assert grace - 0.5 <= took <= grace + 8, took  # ended by the grace, exited a few seconds after it
    for lines in streams:  # every stream ends with an error event and [DONE], never a cut connection
        assert lines[-1] == "[DONE]", lines[-3:]
        assert json.loads(lines[-2])["error"]["code"] == "server_shutting_down", lines[-3:]
    assert "Traceback" not in log and " 500" not in log, log
    events = {e["request_id"]: e for e in spooled(tmp_path / "data" / "audit")}
    for request_id in ids:
        event = events[request_id]
        assert event["status"] == 200 and "interrupted: the server shut down" in event["reasons"], event
