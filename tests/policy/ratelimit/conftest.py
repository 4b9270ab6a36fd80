"""Rate-limit fixtures: a fake clock, principals, and each backend (memory; Redis on loopback).

Redis comes from the ``redis_server`` fixture (tests/conftest.py). Every test gets a key prefix of its own and its keys are deleted
afterwards.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from inferflux.policy.ratelimit import EffectiveLimits, FixedLimits, Limits, MemoryBackend, RateLimiter
from inferflux.policy.ratelimit.checks import Backend
from inferflux.policy.ratelimit.redis_backend import RedisBackend
from inferflux.policy.rbac import Principal

from ratelimit_helpers import FakeClock, LimiterFactory

@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _principal(tenant: str = "ten_a", key: str | None = "key_1", subject: str | None = None) -> Principal:
    return Principal(
        tenant_id=tenant,
        tenant_name=tenant,
        subject=subject or f"key:{key}",
        kind="api_key" if key else "oidc",
        roles=frozenset({"member"}),
        key_id=key,
    )


@pytest.fixture
def make_principal() -> Callable[..., Principal]:
    """``make_principal(tenant="ten_a", key="key_1", subject=None)``; ``key=None`` for an OIDC user."""
    return _principal


@pytest.fixture
def redis_prefix() -> str:
    return f"test-rl:{secrets.token_hex(6)}"


@pytest.fixture
async def redis_backend(redis_server: str, redis_prefix: str) -> AsyncIterator[RedisBackend]:
    backend = RedisBackend.from_url(redis_server, prefix=redis_prefix)
    try:
        yield backend
    finally:
        await backend.delete_all()
        await backend.close()


@pytest.fixture
async def memory_backend(tmp_path: Path) -> AsyncIterator[MemoryBackend]:
    backend = MemoryBackend(tmp_path / "state")
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each backend in turn; the same tests must hold for both."""
    backend: Backend = request.getfixturevalue(f"{request.param}_backend")
    return backend


@pytest.fixture
def make_limiter(backend: Backend, clock: FakeClock) -> LimiterFactory:
    """``make_limiter(tenant=Limits(...), key=Limits(...), **options)`` on the test's backend and clock."""

    def make(tenant: Limits = Limits(), key: Limits = Limits(), **options: Any) -> RateLimiter:
        options.setdefault("clock", clock)
        return RateLimiter(backend, FixedLimits(EffectiveLimits(tenant, key)), **options)

    return make
