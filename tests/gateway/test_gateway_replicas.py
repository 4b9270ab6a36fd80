"""Two `inferctl serve` processes on one PostgreSQL store and one Redis: a change made
through one replica stops a credential on the other within the bound the docs promise
(2 s), and a rate limit holds across both. Usage and budgets (issue 23): three tenants'
usage, served by both, equals the sum of their audit events, cost included; a monthly
token budget stops its tenant at 100 % within one request, on both replicas, and its
50/80/100 % crossings are one audit event each.

This is also the end-to-end test of `inferctl serve` as a real process: start-up
with a bootstrap key from the environment, readiness, and a clean shutdown.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from replica import START_TIMEOUT, Replica
from services import fresh_schema

from inferflux.policy.authn.apikeys import generate_key
from inferflux.policy.store import PolicyStore, StoreSettings

# Real `inferctl serve` processes serving the default model (the tiers: tests/conftest.py);
# serial: a revocation's propagation time and a shared limit's accuracy are measured in real time.
pytestmark = [pytest.mark.model, pytest.mark.serial]

BOUND_SECONDS = 2.0


PASSPHRASE = "correct horse battery staple"


@dataclass
class Pair:
    a: Replica
    b: Replica
    admin_key: str
    store_url: str


@pytest.fixture(scope="module")
def replicas(pg_server: str, redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Two replicas for the module: every start of two processes that load the model costs the
    suite half a minute or more on two cores, and each test works in tenants of its own."""
    directory = tmp_path_factory.mktemp("replicas")
    admin_key = generate_key().token
    with fresh_schema(pg_server) as url:
        env = {
            **os.environ,
            "INFERFLUX_STORE_URL": url,
            "INFERFLUX_STORE_PASSPHRASE": PASSPHRASE,
            "INFERFLUX_BOOTSTRAP_ADMIN_KEY": admin_key,
            # Rate limits shared through Redis; keys are per tenant id, new in this module's store.
            "INFERFLUX_RATELIMIT_BACKEND": "redis",
            "INFERFLUX_REDIS_URL": redis_server,
        }  # and the default auth settings: the bound checked is the one they promise
        # Both start at once: bootstrap and the store's first-start work must cope with a twin.
        a = Replica("replica A", directory / "a", env, directory / "a.log")
        b = Replica("replica B", directory / "b", env, directory / "b.log")
        try:
            deadline = time.monotonic() + START_TIMEOUT
            a.wait_ready(deadline)
            b.wait_ready(deadline)
            yield Pair(a, b, admin_key, url)
        finally:
            codes = [a.stop(), b.stop()]
            for replica, code in zip((a, b), codes, strict=True):
                assert "Traceback" not in replica.output(), replica.output()
                # uvicorn shuts down gracefully, then re-raises the signal it caught.
                assert code in (0, -signal.SIGTERM), f"{replica.name} exited with {code}:\n{replica.output()}"


def status(replica: Replica, key: str, path: str = "/v1/models") -> int:
    return httpx.get(replica.url + path, headers={"authorization": f"Bearer {key}"}, timeout=30).status_code


def seconds_until(replicas: list[Replica], key: str, want: int) -> float:
    """How long until every replica answers ``want`` for ``key`` (fails past twice the bound)."""
    start = time.monotonic()
    pending = list(replicas)
    while pending:
        pending = [r for r in pending if status(r, key) != want]
        elapsed = time.monotonic() - start
        if elapsed > 2 * BOUND_SECONDS:
            raise AssertionError(f"{[r.name for r in pending]} still not {want} after {elapsed:.1f} s")
        time.sleep(0.05)
    return time.monotonic() - start


def admin_call(replica: Replica, admin_key: str, method: str, path: str, body: Any = None) -> Any:
    response = httpx.request(
        method, replica.url + "/admin/v1" + path, json=body, headers={"authorization": f"Bearer {admin_key}"}, timeout=30
    )
    assert response.status_code < 300, response.text
    return response.json()


def test_revocation_and_role_changes_reach_every_replica(replicas: Pair) -> None:
    a, b, admin_key = replicas.a, replicas.b, replicas.admin_key
    # One platform tenant with one platform admin for both: the twin did not bootstrap a second one.
    assert status(a, admin_key) == 200 and status(b, admin_key) == 200
    tenants = [t for t in admin_call(b, admin_key, "GET", "/tenants")["data"] if t["name"] == "platform"]
    assert len(tenants) == 1
    platform_keys = admin_call(a, admin_key, "GET", f"/tenants/{tenants[0]['id']}/keys")["data"]
    assert len(platform_keys) == 1 and platform_keys[0]["role"] == "platform-admin"

    tenant = admin_call(a, admin_key, "POST", "/tenants", {"name": "acme"})
    key = admin_call(a, admin_key, "POST", f"/tenants/{tenant['id']}/keys", {"name": "app", "role": "member"})
    # Both replicas now hold the key's decision in their caches.
    assert status(a, key["key"]) == 200 and status(b, key["key"]) == 200

    admin_call(a, admin_key, "POST", f"/tenants/{tenant['id']}/keys/{key['id']}/revoke")
    took = seconds_until([a, b], key["key"], 401)
    assert took <= BOUND_SECONDS, f"revocation took {took:.2f} s to reach both replicas"

    # A tenant disabled through B stops its other key on A as well, and enabling it brings it back.
    other = admin_call(b, admin_key, "POST", f"/tenants/{tenant['id']}/keys", {"name": "app2", "role": "member"})
    assert status(a, other["key"]) == 200 and status(b, other["key"]) == 200
    admin_call(b, admin_key, "PATCH", f"/tenants/{tenant['id']}", {"disabled": True})
    assert seconds_until([a, b], other["key"], 401) <= BOUND_SECONDS
    admin_call(b, admin_key, "PATCH", f"/tenants/{tenant['id']}", {"disabled": False})
    assert seconds_until([a, b], other["key"], 200) <= BOUND_SECONDS

    # A model allow-list change on A hides the model on B.
    assert status(b, other["key"], "/v1/models/smollm2-135m-instruct") == 200
    admin_call(a, admin_key, "PUT", f"/tenants/{tenant['id']}/models", {"allowed_models": []})
    start = time.monotonic()
    while status(b, other["key"], "/v1/models/smollm2-135m-instruct") != 404:
        assert time.monotonic() - start <= BOUND_SECONDS, "the allow-list change did not reach replica B"
        time.sleep(0.05)


def test_two_replicas_sharing_redis_enforce_one_limit(replicas: Pair, tmp_path: Path) -> None:
    """Twice the allowed load, alternating between both replicas: accepted within 5% of the limit.

    The requests go out at once rather than spread over the minute: the window is a
    minute (counted up to one bucket long), so no request counted leaves it while the
    test runs either way; spreading them only took a minute of wall time. At once, the
    two replicas also race for the last units, which the Lua script must settle.
    """
    a, b, admin_key = replicas.a, replicas.b, replicas.admin_key
    limit = 30
    tenant = admin_call(a, admin_key, "POST", "/tenants", {"name": "limited"})
    key = admin_call(a, admin_key, "POST", f"/tenants/{tenant['id']}/keys", {"name": "app", "role": "member"})["key"]
    store = PolicyStore.open(StoreSettings(url=replicas.store_url, passphrase=PASSPHRASE), tmp_path / "writer")
    try:
        store.create_policy(tenant["id"], "rate_limit", "rpm", {"scope": "tenant", "requests_per_minute": limit})
    finally:
        store.close()
    time.sleep(BOUND_SECONDS)  # both replicas have read the new policy

    sent = 2 * limit
    body = {"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 1}

    def send(i: int) -> int:
        replica = (a, b)[i % 2]
        return httpx.post(
            replica.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60
        ).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        codes = list(pool.map(send, range(sent)))
    accepted = codes.count(200)
    assert set(codes) <= {200, 429}, codes
    assert abs(accepted - limit) <= 0.05 * limit, f"{accepted} accepted of {sent} with a limit of {limit}"
    # Both replicas answered some of each: the limit was shared, not enforced by one alone.
    assert 200 in codes[0::2] and 200 in codes[1::2] and 429 in codes[0::2] and 429 in codes[1::2]


# -- usage and budgets (issue 23) -------------------------------------------------------

MODEL = "smollm2-135m-instruct"
PROMPT = "one two three four five six seven eight"


def complete(replica: Replica, key: str, model: str = MODEL) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3}
    return httpx.post(replica.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=60)  # fmt: skip


def api_events(replica: Replica, admin_key: str, tenant_id: str, kind: str = "api") -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    after = ""
    while True:
        page = admin_call(replica, admin_key, "GET", f"/audit?tenant_id={tenant_id}&kind={kind}&limit=200{after}")
        events += page["data"]
        if not page["next_cursor"]:
            return events
        after = f"&after={page['next_cursor']}"


def eventually(check: Any, what: str, seconds: float = 20.0) -> Any:
    """``check()``'s value once it is truthy (the store's index follows the spools by about a second)."""
    deadline = time.monotonic() + seconds
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what}: not after {seconds} s"
        time.sleep(0.2)
    return value


def test_usage_equals_the_sum_of_audit_events_across_replicas(replicas: Pair) -> None:
    a, b, admin_key = replicas.a, replicas.b, replicas.admin_key
    admin_call(a, admin_key, "PUT", f"/prices/{MODEL}",
               {"prompt_usd_per_million": "1.5", "completion_usd_per_million": 2})  # fmt: skip
    tenants: dict[str, tuple[str, int]] = {}
    for n, name in enumerate(("usage-one", "usage-two", "usage-three")):
        tenant = admin_call(b, admin_key, "POST", "/tenants", {"name": name})
        made = admin_call(a, admin_key, "POST", f"/tenants/{tenant['id']}/keys", {"name": "app", "role": "tenant-admin"})
        tenants[tenant["id"]] = (made["key"], 2 + n)
    time.sleep(BOUND_SECONDS)  # both replicas price with the new table
    sent: dict[str, int] = {}
    for tenant_id, (key, count) in tenants.items():
        codes = [complete((a, b)[i % 2], key).status_code for i in range(count)]
        codes.append(complete(b, key, model="no-such-model").status_code)  # a refusal, by reason
        assert codes == [200] * count + [404], codes
        sent[tenant_id] = count + 1

    for tenant_id, (key, _) in tenants.items():
        def indexed(tenant_id: str = tenant_id) -> list[dict[str, Any]] | None:
            found = api_events(b, admin_key, tenant_id)
            return found if len(found) >= sent[tenant_id] else None

        events = eventually(indexed, "the audit index")
        assert len(events) == sent[tenant_id]
        assert len({e["chain"] for e in events}) == 2  # both replicas recorded the tenant's calls
        prompt = sum(e["prompt_tokens"] or 0 for e in events)
        completion = sum(e["completion_tokens"] or 0 for e in events)
        cost = sum(math.ceil(((e["prompt_tokens"] or 0) * 1_500_000 + (e["completion_tokens"] or 0) * 2_000_000)
                             / 1_000_000) for e in events if e["model"] == MODEL)  # fmt: skip
        reasons: dict[str, int] = {}
        for e in events:
            if e["status"] != 200:
                reason = e["reasons"][0] if e["reasons"] else f"status {e['status']}"
                reasons[reason] = reasons.get(reason, 0) + 1

        def rows(tenant_id: str = tenant_id, expected: int = len(events)) -> list[dict[str, Any]] | None:
            data = admin_call(a, admin_key, "GET", f"/usage?tenant_id={tenant_id}&by=tenant")["data"]
            return data if data and sum(r["requests"] for r in data) == expected else None

        usage = eventually(rows, "the usage rollup")
        assert len(usage) == 1  # one day: the test's
        row = usage[0]
        assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (len(events), prompt, completion)
        assert row["cost_usd"] == f"{cost // 1_000_000}.{cost % 1_000_000:06d}" and cost > 0
        assert row["refusals"] == reasons and row["refused"] == 1
        minutes = admin_call(b, admin_key, "GET", f"/usage?tenant_id={tenant_id}&group=minute&by=model")["data"]
        assert sum(r["requests"] for r in minutes) == len(events)
        assert sum(r["prompt_tokens"] for r in minutes if r["model"] == MODEL) == prompt

        # A tenant admin reads its own tenant's usage, as CSV too, and another tenant's is 404.
        own = httpx.get(a.url + "/admin/v1/usage?format=csv", headers={"authorization": f"Bearer {key}"}, timeout=30)
        assert own.status_code == 200 and own.headers["content-type"].startswith("text/csv"), own.text
        assert own.text.splitlines()[1].split(",")[1:4] == [tenant_id, str(len(events)), "1"]
        other = next(t for t in tenants if t != tenant_id)
        foreign = httpx.get(a.url + f"/admin/v1/usage?tenant_id={other}", headers={"authorization": f"Bearer {key}"},
                            timeout=30)  # fmt: skip
        assert foreign.status_code == 404 and foreign.json()["error"]["code"] == "not_found"


def test_a_budget_stops_its_tenant_at_100_percent_across_replicas(replicas: Pair) -> None:
    a, b, admin_key = replicas.a, replicas.b, replicas.admin_key
    budget = 50
    tenant = admin_call(a, admin_key, "POST", "/tenants", {"name": "budgeted"})
    key = admin_call(b, admin_key, "POST", f"/tenants/{tenant['id']}/keys", {"name": "app", "role": "member"})["key"]
    admin_call(b, admin_key, "POST", f"/tenants/{tenant['id']}/policies",
               {"kind": "budget", "name": "monthly", "spec": {"tokens": budget}})  # fmt: skip
    time.sleep(BOUND_SECONDS)  # both replicas have read the budget
    used, admitted = 0, 0
    while True:
        response = complete((a, b)[admitted % 2], key)
        if response.status_code != 200:
            break
        assert used < budget, f"admitted with {used} of {budget} tokens used"  # never past 100 %
        used += response.json()["usage"]["total_tokens"]
        admitted += 1
        time.sleep(0.3)  # its settlement (off the request path) is in before the next request
        assert admitted < 20
    # The request that crossed 100 % ran; the next one, on either replica, is refused.
    assert used >= budget and admitted >= 2, (used, admitted)
    for replica in (a, b):
        refused = complete(replica, key)
        error = refused.json()["error"]
        assert refused.status_code == 429 and error["code"] == "budget_exceeded", refused.text
        assert "monthly token budget of this tenant" in error["message"] and f"budget {budget} tokens" in error["message"]
    # 50, 80 and 100 % are one audit event each, whichever replica saw them first.
    def alerts() -> list[dict[str, Any]]:
        return [e for e in api_events(a, admin_key, tenant["id"], "admin") if e["action"] == "budget.threshold"]

    eventually(lambda: len(alerts()) >= 3, "the budget alerts")
    time.sleep(1.5)  # and no fourth comes (each replica saw the crossings of the requests it settled)
    found = alerts()
    assert sorted(e["detail"]["threshold_percent"] for e in found) == [50, 80, 100]
    assert all(e["detail"]["limit"] == str(budget) and e["detail"]["scope"] == "tenant" for e in found)
