"""The Redis backend: one round trip per step, namespaced expiring keys, failure modes, and one
limit enforced across two OS processes."""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Connection, ConnectionPool, Redis

from inferflux.policy.ratelimit import Admission, EffectiveLimits, FixedLimits, Limits, RateLimiter, RateLimiterUnavailable
from inferflux.policy.ratelimit import redis_backend
from inferflux.policy.ratelimit.redis_backend import RedisBackend

from ratelimit_helpers import PrincipalFactory

REPO = Path(__file__).resolve().parents[3]
ALL_LIMITS = Limits(
    requests_per_minute=10,
    tokens_per_minute=1000,
    concurrent_requests=2,
    tokens_per_day=10_000,
    tokens_per_month=99_999,
)


class CountingConnection(Connection):
    """Records the name of every command written to Redis (a pipeline would be one write)."""

    sent: list[str] = []

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        raw = command if isinstance(command, bytes | bytearray | memoryview) else b"".join(bytes(c) for c in command)
        CountingConnection.sent.append(bytes(raw).split(b"\r\n")[2].decode().upper())
        await super().send_packed_command(command, check_health)


@pytest.fixture
async def counting(redis_server: str, redis_prefix: str) -> AsyncIterator[RedisBackend]:
    client = Redis(connection_pool=ConnectionPool.from_url(redis_server, connection_class=CountingConnection))
    backend = RedisBackend(client, prefix=redis_prefix)
    try:
        yield backend
    finally:
        await backend.delete_all()
        await client.aclose()


def limiter_on(backend: Any, limits: Limits = ALL_LIMITS, **options: Any) -> RateLimiter:
    return RateLimiter(backend, FixedLimits(EffectiveLimits(tenant=limits, key=limits)), **options)


async def test_one_round_trip_per_step(counting: RedisBackend, make_principal: PrincipalFactory) -> None:
    limiter = limiter_on(counting)
    me = make_principal()
    # The server must know every script first: on a fresh one (a new CI machine, this test the first to
    # renew a lease) the first EVALSHA of each gets NOSCRIPT and is sent again as EVAL.
    for script in (redis_backend._RESERVE, redis_backend._RENEW, redis_backend._SETTLE):
        assert await counting.client.script_load(script.source) == script.sha
    await limiter.check_and_reserve(me, prompt_tokens=5, max_tokens=5)  # one running request of the two renewed below
    CountingConnection.sent.clear()
    # ten counters (five limits, tenant and key) checked and charged in one call
    admission = await limiter.check_and_reserve(me, prompt_tokens=5, max_tokens=5)
    assert isinstance(admission, Admission) and len(admission.handle.checks) == 10
    assert CountingConnection.sent == ["EVALSHA"]
    CountingConnection.sent.clear()
    await limiter.renew_leases()
    assert CountingConnection.sent == ["EVALSHA", "EVALSHA"]  # one per running request
    CountingConnection.sent.clear()
    await limiter.settle(admission.handle, prompt_tokens=5, completion_tokens=1)
    assert CountingConnection.sent == ["EVALSHA"]


async def test_an_unknown_script_is_sent_once(
    counting: RedisBackend, make_principal: PrincipalFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A script the server has never seen (as after a restart or SCRIPT FLUSH), without flushing a shared server.
    fresh = redis_backend._Script(redis_backend.RESERVE + f"\n-- {secrets.token_hex(8)}")
    monkeypatch.setattr(redis_backend, "_RESERVE", fresh)
    limiter = limiter_on(counting)
    await counting.client.ping()
    CountingConnection.sent.clear()
    await limiter.check_and_reserve(make_principal(), prompt_tokens=1)
    assert CountingConnection.sent == ["EVALSHA", "EVAL"]
    CountingConnection.sent.clear()
    await limiter.check_and_reserve(make_principal(), prompt_tokens=1)
    assert CountingConnection.sent == ["EVALSHA"]


async def test_keys_are_namespaced_and_expire(
    redis_backend: RedisBackend, redis_prefix: str, make_principal: PrincipalFactory, clock: Any
) -> None:
    limiter = limiter_on(redis_backend, clock=clock)
    admission = await limiter.check_and_reserve(make_principal(), prompt_tokens=5, max_tokens=5)
    assert isinstance(admission, Admission)
    client = redis_backend.client
    keys = sorted(os.fsdecode(k) for k in await client.keys(f"{redis_prefix}:*"))
    assert len(keys) == 10
    for key in keys:
        assert key.startswith(f"{redis_prefix}:{{ten_a}}:")  # one cluster slot per tenant
        ttl = await client.pttl(key)
        assert ttl > 0, key
        if ":rpm:" in key or ":tpm:" in key:
            assert ttl <= 62_000
        elif key.endswith(":conc"):
            assert ttl <= 31_000
    # quota counters live until two days after their period (UTC), then go
    day = next(k for k in keys if k.endswith(":quota:2030-12-31"))
    expires = await client.pexpiretime(day)
    assert expires == (datetime(2031, 1, 1, tzinfo=UTC).timestamp() + 2 * 86_400) * 1000
    await limiter.settle(admission.handle, prompt_tokens=5, completion_tokens=5)
    assert not [k for k in await client.keys(f"{redis_prefix}:*") if os.fsdecode(k).endswith(":conc")]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
async def dead_redis() -> AsyncIterator[RedisBackend]:
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{closed_port()}/0", prefix="nowhere")
    try:
        yield backend
    finally:
        await backend.close()


async def test_redis_down_fail_open(
    dead_redis: RedisBackend, make_principal: PrincipalFactory, caplog: pytest.LogCaptureFixture
) -> None:
    failures: list[str] = []
    limiter = limiter_on(
        dead_redis, Limits(requests_per_minute=1), fail_open=True, retry_backend_after=0, on_failure=failures.append
    )
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="inferflux.policy.ratelimit"):
        for _ in range(5):
            admission = await limiter.check_and_reserve(make_principal(), prompt_tokens=1)
            assert isinstance(admission, Admission) and not admission.handle.counted
            await limiter.settle(admission.handle, prompt_tokens=1, completion_tokens=1)
    assert time.monotonic() - started < 5
    assert limiter.backend_failures == 5 and failures == ["check"] * 5
    lines = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 1  # one line, not one per request
    assert "unavailable" in lines[0].getMessage() and "fail-open" in lines[0].getMessage()


async def test_redis_down_fail_closed(dead_redis: RedisBackend, make_principal: PrincipalFactory) -> None:
    limiter = limiter_on(dead_redis, Limits(requests_per_minute=100))
    for _ in range(3):
        with pytest.raises(RateLimiterUnavailable) as info:
            await limiter.check_and_reserve(make_principal(), prompt_tokens=1)
        error = info.value
        assert (error.status_code, error.error_type, error.code) == (503, "server_error", "rate_limiter_unavailable")
        assert error.headers == {"retry-after": "1"}
    # after the first failure the backend is left alone for a second instead of timing out per request
    assert limiter.backend_failures == 3
    # a principal without limits never needed Redis
    unlimited = limiter_on(dead_redis, Limits())
    assert isinstance(await unlimited.check_and_reserve(make_principal(), prompt_tokens=1), Admission)


async def test_redis_lost_mid_request_never_raises(
    redis_backend: RedisBackend, dead_redis: RedisBackend, make_principal: PrincipalFactory
) -> None:
    limiter = limiter_on(redis_backend, Limits(concurrent_requests=1), retry_backend_after=0)
    admission = await limiter.check_and_reserve(make_principal(), prompt_tokens=1)
    assert isinstance(admission, Admission)
    limiter.backend = dead_redis  # Redis goes away while the request runs
    await limiter.renew_leases()
    await limiter.settle(admission.handle, prompt_tokens=1, completion_tokens=1)
    assert limiter.backend_failures == 2


# The acceptance test runs this for a full minute: INFERFLUX_RATELIMIT_WINDOW_SECONDS=60.
WINDOW = float(os.environ.get("INFERFLUX_RATELIMIT_WINDOW_SECONDS", "5"))
LIMIT = int(os.environ.get("INFERFLUX_RATELIMIT_LIMIT", "100"))


@pytest.mark.serial  # each process must really offer twice the limit in the window
async def test_two_processes_enforce_one_limit(redis_server: str, redis_prefix: str) -> None:
    start = time.time() + 3  # both start together, once imported
    rate = 2 * LIMIT / WINDOW  # each process alone offers twice the limit
    command = [sys.executable, str(Path(__file__).with_name("hammer.py")), "--url", redis_server]
    for name, value in [("prefix", redis_prefix), ("limit", LIMIT), ("window", WINDOW), ("rate", rate)]:
        command += [f"--{name}", str(value)]
    command += ["--start", str(start), "--duration", str(WINDOW)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([*command, "--name", f"key_p{i}"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=WINDOW + 60)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        cleanup = RedisBackend.from_url(redis_server, prefix=redis_prefix)
        await cleanup.delete_all()
        await cleanup.close()
    assert [proc.returncode for proc in procs] == [0, 0]
    results = [json.loads(out) for out in outputs]
    accepted = sum(r["accepted"] for r in results)
    assert all(r["failures"] == 0 for r in results)
    assert sum(r["sent"] for r in results) >= 3 * LIMIT  # the load really was about four times the limit
    assert all(r["accepted"] > 0 for r in results)  # both processes drew from the one limit
    assert abs(accepted - LIMIT) <= 0.05 * LIMIT, results
