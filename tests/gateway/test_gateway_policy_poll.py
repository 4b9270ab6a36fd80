"""One poller of the store's ``policy_version`` for authentication, limits and guardrails: no request waits for it.

Each resolver used to read the version itself, in the first request after its poll
interval: a client sending a request every few seconds had every request wait for two
store reads (a thread hop each, a network round trip on PostgreSQL). The authenticator's
background poller reads it every interval anyway and hands each reading to the limit and
guardrail resolvers (``Authenticator.on_version``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from inferflux.gateway.context import CURRENT
from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from http_helpers import bearer
from inferflux.policy.store import PolicyStore, StoreSettings

POLL = 0.2


def test_requests_never_wait_for_a_read_of_the_policy_version(make_app: Any, tmp_path: Path) -> None:
    store = PolicyStore.open(StoreSettings(), tmp_path)
    tenant = store.create_tenant("acme")
    store.create_policy(tenant.id, "rate_limit", "rpm", {"requests_per_minute": 1000})
    store.create_policy(tenant.id, "guardrail", "words", {"blocklist": [{"literal": "forbidden"}]})
    key = store.create_api_key(tenant.id, "k", "member")[1]
    reads: list[bool] = []  # per read of the version: whether a request made it
    read_version = store.policy_version

    def counted() -> int:
        # asyncio's and AnyIO's worker threads run in the caller's context: a request's read sees it.
        reads.append(CURRENT.get() is not None)
        return read_version()

    store.policy_version = counted  # type: ignore[method-assign]
    app = make_app(store, data_dir=str(tmp_path), auth={"revocation_poll_seconds": POLL})
    try:
        with TestClient(app) as client:
            for i in range(6):  # more than a poll interval apart: each would have read the version itself
                time.sleep(1.25 * POLL)
                body = {"model": DEFAULT_MODEL_NAME, "prompt": f"Count to {i}", "max_tokens": 1}
                response = client.post("/v1/completions", json=body, headers=bearer(key))
                assert response.status_code == 200, response.text
            # Still enforced from the poller's readings: a new blocklist word refuses within a few intervals.
            store.create_policy(tenant.id, "guardrail", "more", {"blocklist": [{"literal": "octopus"}]})
            time.sleep(3 * POLL)
            body = {"model": DEFAULT_MODEL_NAME, "prompt": "an octopus", "max_tokens": 1}
            refused = client.post("/v1/completions", json=body, headers=bearer(key))
            assert refused.status_code == 400, refused.text
    finally:
        store.close()
    assert reads.count(False) >= 6  # the poller's
    assert reads.count(True) == 0
