"""The policy store's stale window under a real network fault: PostgreSQL behind a TCP proxy that is cut.

The window starts at the last successful store read, whatever was written
before it: an admin write elsewhere just before the outage must not take the
warm keys' cached decisions away, and ``/readyz`` says 503 exactly when those
keys' chats are refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fault_proxy import FaultProxy
from http_helpers import bearer, error_of
from pg_cluster import wait_until
from servers import start_uvicorn, stop_uvicorn
from services import fresh_schema

MODEL = "smollm2-135m-instruct"


@pytest.fixture
def proxied_pg(pg_server: str) -> Iterator[tuple[str, FaultProxy]]:
    """A fresh schema's URL that reaches PostgreSQL through a ``FaultProxy``, and the proxy."""
    from sqlalchemy.engine import make_url

    with fresh_schema(pg_server) as url:
        direct = make_url(url)
        proxy = FaultProxy(direct.host or "127.0.0.1", direct.port or 5432).start()
        try:
            yield direct.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False), proxy
        finally:
            proxy.close()


def chat(url: str, key: str, text: str = "Hi") -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer(key), timeout=60)


def readiness(url: str) -> tuple[int, dict[str, Any]]:
    response = httpx.get(f"{url}/readyz", timeout=10)
    return response.status_code, response.json()


def test_an_admin_write_before_an_outage_keeps_warm_keys_served_and_readyz_agrees(
    proxied_pg: tuple[str, FaultProxy], served_model: Any, tmp_path: Path
) -> None:
    from inferflux.gateway.app import create_app
    from inferflux.gateway.models.served import ModelManager
    from inferflux.gateway.settings import Settings
    from inferflux.policy.store import PolicyStore, StoreSettings

    url, proxy = proxied_pg
    stale_seconds = 12.0
    store_settings = {"url": url, "stale_seconds": stale_seconds}
    store = PolicyStore.open(StoreSettings(**store_settings), tmp_path)
    admin = str(store.ensure_bootstrap_admin())
    acme, globex, other = (store.create_tenant(name) for name in ("acme", "globex", "other"))
    warm = [store.create_api_key(acme.id, "warm", "member")[1], store.create_api_key(globex.id, "warm", "member")[1]]
    _, cold = store.create_api_key(acme.id, "cold", "member")
    revoked_record, revoked = store.create_api_key(acme.id, "revoked", "member")
    store.create_policy(acme.id, "guardrail", "words", {"blocklist": [{"id": "w1", "literal": "bluebird"}]})
    store.create_policy(acme.id, "rate_limit", "rl", {"scope": "tenant", "requests_per_minute": 1000})
    manager = ModelManager(expected=[served_model.name])
    manager.add(served_model)
    settings = Settings(data_dir=tmp_path / "app", store=store_settings, auth={"revocation_poll_seconds": 0.2})
    server, thread, sock, base = start_uvicorn(create_app(settings, manager, store=store, owns_models=False))
    try:
        for key in (*warm, str(revoked)):
            assert chat(base, str(key)).status_code == 200
        assert error_of(chat(base, str(warm[0]), "a bluebird"))["code"] == "content_filter"
        # A revocation this replica has seen stays seen through the outage.
        store.revoke_api_key(acme.id, revoked_record.id)
        assert wait_until(lambda: chat(base, str(revoked)).status_code == 401, timeout=10)
        # One admin write in another tenant, seen by the pollers, then the store goes away.
        made = httpx.post(f"{base}/admin/v1/tenants/{other.id}/keys", json={"name": "late", "role": "member"},
                          headers=bearer(admin), timeout=30)  # fmt: skip
        assert made.status_code == 201, made.text
        time.sleep(1.0)  # five polls: every replica cache has seen the new policy_version
        proxy.cut()
        cut_at = time.monotonic()

        for key in warm:  # served from the snapshot, with their limits and guardrails
            answer = chat(base, str(key))
            assert answer.status_code == 200, answer.text
        assert error_of(chat(base, str(warm[0]), "a bluebird"))["code"] == "content_filter"
        status, body = readiness(base)
        assert status == 200 and any("snapshot" in d for d in body.get("degraded", [])), body
        assert error_of(chat(base, str(cold)))["code"] == "policy_store_unavailable"  # never seen
        assert chat(base, str(revoked)).status_code in (401, 503)  # refused before the outage: never served

        # Until the window closes and after: /readyz answers as a warm key's chat does.
        pairs = []
        while time.monotonic() < cut_at + stale_seconds + 3:
            before = readiness(base)[0]
            served = chat(base, str(warm[1])).status_code
            after = readiness(base)[0]
            if before == after:
                pairs.append((before, served))
        assert (200, 200) in pairs and (503, 503) in pairs, pairs
        assert all(ready == served for ready, served in pairs), pairs
        status, body = readiness(base)
        assert status == 503 and any("policy store" in r for r in body["reasons"]), body

        proxy.restore()
        assert wait_until(lambda: readiness(base) == (200, {"status": "ok"}), timeout=15)
        assert all(chat(base, str(key)).status_code == 200 for key in warm)
    finally:
        stop_uvicorn(server, thread, sock)
        store.close()
