"""Bounded priority and fair sharing between tenants, on the request path.

The priority a request may ask for is bounded by its traffic policy (400
``priority`` outside the bounds), and the engine shares its batch between
tenants: one tenant's flood does not queue another tenant's requests behind it.
The flood test runs a real server on a loopback socket with a small batch (8
seats), so that the flood really queues, and asserts the order requests are
served in, not their speed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from http_helpers import bearer, error_of
from inferflux.policy.store import PolicyStore, StoreSettings
from servers import start_uvicorn, stop_uvicorn
from streams import SEATS, first_token_at

MODEL = DEFAULT_MODEL_NAME
POLL = 0.05


class World:
    def __init__(self, store: PolicyStore, client: TestClient) -> None:
        self.store, self.client = store, client
        self.n = 0

    def tenant_key(self) -> tuple[Any, str]:
        self.n += 1
        tenant = self.store.create_tenant(f"p{self.n}")
        return tenant, self.store.create_api_key(tenant.id, "k", "member")[1]

    def complete(self, key: str, **extra: Any) -> httpx.Response:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0, **extra}
        return self.client.post("/v1/completions", json=body, headers=bearer(key))


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    data_dir = tmp_path_factory.mktemp("fairness")
    store = PolicyStore.open(StoreSettings(), data_dir)
    app = make_app(store, data_dir=str(data_dir), auth={"revocation_poll_seconds": POLL})
    with TestClient(app) as client:
        yield World(store, client)
    store.close()


def test_by_default_a_caller_may_only_lower_its_importance(world: World) -> None:
    _, key = world.tenant_key()
    for priority in (-1, -1000, 1001, 10**30):
        refused = world.complete(key, priority=priority)
        assert refused.status_code == 400, refused.text
        error = error_of(refused)
        assert error["param"] == "priority" and error["type"] == "invalid_request_error"
        assert "0 to 1000" in error["message"]
    for priority in (0, 7, 1000):
        assert world.complete(key, priority=priority).status_code == 200
    assert world.complete(key).status_code == 200


def test_a_traffic_policy_sets_the_bounds(world: World) -> None:
    tenant, key = world.tenant_key()
    vip = world.store.create_api_key(tenant.id, "vip", "member")
    world.store.create_policy(tenant.id, "rate_limit", "sched", {"min_priority": 3, "max_priority": 9})
    world.store.create_policy(tenant.id, "rate_limit", "vip", {"scope": "key", "principal": vip[0].id,
                                                                "min_priority": -5})  # fmt: skip
    time.sleep(3 * POLL)
    assert world.complete(key, priority=2).status_code == 400
    assert world.complete(key, priority=10).status_code == 400
    assert world.complete(key, priority=3).status_code == 200
    assert world.complete(key).status_code == 200  # no priority given: the lowest allowed, 3
    assert world.complete(vip[1], priority=-5).status_code == 200  # its key's policy lets it outrank
    assert error_of(world.complete(vip[1], priority=-6))["param"] == "priority"


# -- a flood from one tenant, over a real socket ----------------------------------------------

FLOOD = 24  # tenant a's streams, all sent at once (the engine seats SEATS: the flood queues)


def test_a_flood_does_not_queue_another_tenants_requests(
    small_batch_model: Any, tmp_path: Path, app_for_model: Any
) -> None:
    store = PolicyStore.open(StoreSettings(), tmp_path)
    flooder = store.create_tenant("flooder")
    flood_key = store.create_api_key(flooder.id, "k", "member")[1]
    polite = store.create_tenant("polite")
    polite_key = store.create_api_key(polite.id, "k", "member")[1]
    server, thread, sock, url = start_uvicorn(app_for_model(small_batch_model, store, data_dir=str(tmp_path / "app")))
    engine = small_batch_model.engine

    async def scenario() -> list[tuple[int, int]]:
        stamps: dict[str, float] = {}
        overtaken: list[tuple[int, int]] = []  # per b request: (a's requests queued when it was sent, of those served first)
        limits = httpx.Limits(max_connections=FLOOD + 4)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            flood = [asyncio.ensure_future(first_token_at(client, flood_key, 16, stamps, f"a{i}"))
                     for i in range(FLOOD)]  # fmt: skip
            deadline = time.monotonic() + 60
            while engine.stats().num_waiting < 2 * SEATS:  # a's flood is queued behind a full batch
                assert time.monotonic() < deadline, "the flood never queued"
                await asyncio.sleep(0.01)
            for b in range(3):
                if engine.stats().num_waiting < 2 * SEATS:
                    break  # the flood has mostly been served
                queued = {f"a{i}" for i in range(FLOOD)} - set(stamps)
                await first_token_at(client, polite_key, 2, stamps, f"b{b}")
                first = stamps[f"b{b}"]
                overtaken.append((len(queued), sum(1 for a in queued if a in stamps and stamps[a] < first)))
            await asyncio.gather(*flood)
        return overtaken

    try:
        overtaken = asyncio.run(scenario())
    finally:
        stop_uvicorn(server, thread, sock)
        store.close()
    assert overtaken
    for queued, served_first in overtaken:
        # FIFO would serve every one of them first. At most one batch's worth may start before b:
        # the seats freed in b's step, or freed while b's request crosses a loaded gateway (seen
        # once at load 12 in the hostile-tenant test: 4 of 24 served first).
        assert queued >= 2 * SEATS and served_first <= SEATS, overtaken


def test_a_tenant_queues_no_deeper_than_its_share(small_batch_model: Any, tmp_path: Path, app_for_model: Any) -> None:
    """A flood fills its tenant's share of the queue and gets 429 beyond it; the rest stays open to others."""
    share = 3
    store = PolicyStore.open(StoreSettings(), tmp_path)
    keys = {}
    for name in ("flooder", "polite"):
        keys[name] = store.create_api_key(store.create_tenant(name).id, "k", "member")[1]
    flooder_id = store.get_tenant_by_name("flooder").id
    app = app_for_model(small_batch_model, store, data_dir=str(tmp_path / "app"), max_queued_sequences_per_tenant=share)
    server, thread, sock, url = start_uvicorn(app)
    engine = small_batch_model.engine

    async def scenario() -> tuple[httpx.Response, dict[str, float]]:
        stamps: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=16)) as client:
            flood = [asyncio.ensure_future(first_token_at(client, keys["flooder"], 48, stamps, f"a{i}"))
                     for i in range(SEATS + share)]  # fmt: skip
            deadline = time.monotonic() + 60
            while engine.stats().waiting_per_tenant.get(flooder_id, 0) < share:
                assert time.monotonic() < deadline, "the flood never filled its share"
                await asyncio.sleep(0.01)
            body = {"model": MODEL, "prompt": "one more", "max_tokens": 1}
            refused = await client.post("/v1/completions", json=body, headers=bearer(keys["flooder"]))
            await first_token_at(client, keys["polite"], 1, stamps, "b")  # asserts its 200
            await asyncio.gather(*flood)
        return refused, stamps

    try:
        refused, stamps = asyncio.run(scenario())
    finally:
        stop_uvicorn(server, thread, sock)
        store.close()
    assert refused.status_code == 429, refused.text
    assert error_of(refused)["code"] == "tenant_queue_full"
    assert refused.headers["retry-after"] == "1"
    assert len(stamps) == SEATS + share + 1  # every admitted stream, and the other tenant's, was served
