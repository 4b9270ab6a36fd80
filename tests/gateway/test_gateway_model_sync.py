"""Replicas follow the store's model registry (issue 20, point 4), in process.

Two apps over ONE SQLite store stand for two replicas: a model loaded, made
the default or unloaded through A's admin API reaches B within a few of its
polls (``model_registry.poll_seconds``) plus B's own load time. A load from
the registry that fails is tried again only once the store changes, and a
store that cannot be read does not stop the loop. Real processes over
PostgreSQL: ``test_gateway_three_replicas.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from inferflux.backends.models import default_model_path
from inferflux.gateway.models.sync import RegistryPoller
from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from inferflux.policy.errors import StoreUnavailable
from inferflux.policy.store import PolicyStore, StoreSettings
from audit_wait import eventually

POLL = 0.1
# "A few polls": B answers within this once A's change is in the store (a 2-core machine running other work).
FOLLOW_SECONDS = 2.0
LOAD_TIMEOUT = 180.0
SECOND = {"name": "second", "path": default_model_path(), "dtype": "float32", "aliases": ["twin"]}


@pytest.fixture(scope="module")
def replicas(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    store = PolicyStore.open(StoreSettings(), tmp_path_factory.mktemp("model-sync"))
    admin = {"authorization": f"Bearer {store.ensure_bootstrap_admin()}"}
    settings = {"engine": {"kv_cache_bytes": 32 * 1024 * 1024}, "model_registry": {"poll_seconds": POLL}}
    a_app, b_app = make_app(store, **settings), make_app(store, **settings)
    try:
        with TestClient(a_app) as a, TestClient(b_app) as b:
            yield {"store": store, "a": a, "b": b, "admin": admin}
    finally:
        # The apps do not own the engines: shut down what the registry loaded, also after a failure.
        for app in (a_app, b_app):
            for model in app.state.manager:
                if model.name not in app.state.model_admin.configured:
                    model.shutdown()
        store.close()


def status(client: TestClient, admin: dict[str, str], name: str) -> dict[str, Any]:
    response = client.get(f"/admin/v1/models/{name}", headers=admin)
    return response.json() if response.status_code == 200 else {"status": response.status_code}


def served(client: TestClient, admin: dict[str, str]) -> list[str]:
    return [m["id"] for m in client.get("/v1/models", headers=admin).json()["data"]]


def default_of(client: TestClient, admin: dict[str, str]) -> str:
    return next(m["id"] for m in client.get("/admin/v1/models", headers=admin).json()["data"] if m.get("default"))


def test_a_load_a_default_and_an_unload_through_one_replica_reach_the_other(replicas: dict[str, Any]) -> None:
    a, b, admin = replicas["a"], replicas["b"], replicas["admin"]
    assert a.post("/admin/v1/models", headers=admin, json=SECOND).status_code == 202
    eventually(lambda: status(a, admin, "second")["status"], lambda s: s != "loading", timeout=LOAD_TIMEOUT)
    assert status(a, admin, "second")["status"] == "ready"
    assert [r.name for r in replicas["store"].list_served_models()] == ["second"]

    # B starts loading it within a few polls, then serves it (by name and alias).
    eventually(lambda: status(b, admin, "second")["status"], lambda s: s in ("loading", "ready"),
               timeout=FOLLOW_SECONDS, what="B taking up the model")  # fmt: skip
    eventually(lambda: status(b, admin, "second")["status"], lambda s: s != "loading", timeout=LOAD_TIMEOUT)
    b_status = status(b, admin, "second")
    assert b_status["status"] == "ready" and b_status["source"] == "admin" and b_status["aliases"] == ["twin"]
    assert served(b, admin).count("second") == 1
    chat = {"model": "twin", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answer = b.post("/v1/chat/completions", headers=admin, json=chat)
    assert answer.status_code == 200 and answer.json()["model"] == "second"
    # A did not load its own model a second time.
    assert [m.name for m in a.app.state.manager].count("second") == 1 and a.app.state.model_admin._loads == {}

    # The default, through A, then back to the configured model through B.
    assert a.post("/admin/v1/models/second/default", headers=admin).json()["default"] is True
    eventually(lambda: default_of(b, admin), lambda d: d == "second", timeout=FOLLOW_SECONDS, what="B's default")
    assert b.post(f"/admin/v1/models/{DEFAULT_MODEL_NAME}/default", headers=admin).status_code == 200
    eventually(lambda: default_of(a, admin), lambda d: d == DEFAULT_MODEL_NAME, timeout=FOLLOW_SECONDS,
               what="A's default back to the configured model")  # fmt: skip

    # An unload through A: gone from B too, its engine stopped.
    b_engine = b.app.state.manager.get("second").engine
    assert a.delete("/admin/v1/models/second", headers=admin).status_code == 204
    eventually(lambda: served(b, admin), lambda ids: "second" not in ids, timeout=FOLLOW_SECONDS, what="B unloading")
    assert status(b, admin, "second")["status"] == 404
    eventually(lambda: b_engine.is_running, lambda running: not running, timeout=30, what="B's engine stopping")
    assert replicas["store"].list_served_models() == []


def test_a_failed_load_from_the_registry_is_tried_again_only_when_the_store_changes(
    replicas: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inferflux.gateway.models import admin as model_admin

    a, b, admin, store = replicas["a"], replicas["b"], replicas["admin"], replicas["store"]
    attempts: list[str] = []
    real_load = model_admin.load_served_model

    def counted(*args: Any, **kwargs: Any) -> Any:
        attempts.append(args[0].name)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(model_admin, "load_served_model", counted)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)  # the right name and magic, nothing loadable
    store.create_served_model("broken", path=str(broken), dtype="float32")  # as another replica would have

    for client in (a, b):  # each replica tries it once, and shows why it failed
        failed = eventually(lambda c=client: status(c, admin, "broken"), lambda s: s["status"] == "failed",
                            timeout=FOLLOW_SECONDS, what="the failed load")  # fmt: skip
        assert failed["error"] and failed["source"] == "admin"
    time.sleep(10 * POLL)
    assert attempts == ["broken", "broken"]

    store.create_tenant("any-change")  # the store moved: one more try each
    eventually(lambda: len(attempts), lambda n: n == 4, timeout=FOLLOW_SECONDS, what="a try after the change")
    time.sleep(10 * POLL)
    assert len(attempts) == 4

    # DELETE on a replica where it failed takes it out of the registry: every replica forgets it.
    assert b.delete("/admin/v1/models/broken", headers=admin).status_code == 204
    assert store.list_served_models() == []
    eventually(lambda: status(a, admin, "broken")["status"], lambda s: s == 404, timeout=FOLLOW_SECONDS)
    assert status(b, admin, "broken")["status"] == 404 and len(attempts) == 4


class FlakyStore:
    """A store whose ``policy_version`` fails while ``down``; it moves when told."""

    def __init__(self) -> None:
        self.version = 1
        self.down = False

    def policy_version(self) -> int:
        if self.down:
            raise StoreUnavailable("The policy store is unavailable; retry shortly")
        return self.version


def test_a_store_outage_is_logged_once_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    store = FlakyStore()
    converged: list[int] = []

    async def converge(version: int) -> None:
        converged.append(version)

    async def scenario() -> None:
        poller = RegistryPoller(store, converge, lambda: False, interval=0.01)  # type: ignore[arg-type]
        poller.start()
        try:
            await wait_for(lambda: converged == [1])  # the first poll converges
            store.down = True
            await asyncio.sleep(0.2)  # some twenty failed polls
            store.version, store.down = 2, False
            await wait_for(lambda: converged == [1, 2])
            await asyncio.sleep(0.05)
            assert converged == [1, 2]  # the version did not move again: no more rounds
        finally:
            await poller.stop()

    with caplog.at_level(logging.INFO, logger="inferflux.gateway.models.sync"):
        asyncio.run(scenario())
    messages = [r.getMessage() for r in caplog.records if r.name == "inferflux.gateway.models.sync"]
    assert len(messages) == 2, messages
    assert "cannot follow the model registry" in messages[0] and "unavailable" in messages[0]
    assert "again" in messages[1]


async def wait_for(done: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.01)
