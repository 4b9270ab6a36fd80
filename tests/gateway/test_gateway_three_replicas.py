"""Three `inferctl serve` processes over one PostgreSQL store and one Redis share their limits
and their audit trail (issue 20, point 4):

- a tenant's request rate and its token quota, set through the admin API, admit (and
  charge) within 5 % of what one replica alone would, when the load is spread round-robin
  over the three; the quota's reservations are settled to the real counts whichever
  replica admitted them;
- one audit query, on any replica, returns the events of all three, in time order, each
  naming the chain (the replica) that recorded it, scoped to the caller's tenant as on one
  replica; and every replica's chain still verifies;
- they follow the store's model registry: a model loaded through replica 1's admin API is
  taken up by replicas 2 and 3 within 2 s (then served once their own load is done), a
  default set through one replica moves every replica's, and an unload through one leaves
  every replica (the in-process version, with the failure and outage cases, is
  ``test_gateway_model_sync.py``).

The replicas are started once for the module (their model loads overlap, and every start
of three processes that load the model costs the suite about a minute on two cores); each
test works in tenants of its own, and the registry test leaves the replicas serving what
they started with. Two replicas and a credential change: ``test_gateway_replicas.py``.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from http_helpers import bearer
from replica import Replica, fleet
from services import fresh_schema

from inferflux.backends.models import default_model_path
from inferflux.policy.audit.chain import parse_record
from inferflux.policy.audit.cli import spool_chain_id, verify_spool
from inferflux.policy.audit.spool import segment_files
from inferflux.policy.authn.apikeys import generate_key

# Real `inferctl serve` processes serving the default model (the tiers: tests/conftest.py);
# PostgreSQL and Redis make them service tests as well. Serial: limits' accuracy and the
# registry's propagation time are measured in real time, with three model processes on the cores.
pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.serial]

MODEL = "smollm2-135m-instruct"
POLL_SECONDS = 0.25  # auth.revocation_poll_seconds: a new policy reaches every replica within about this
TOLERANCE = 0.05


@dataclass
class Cluster:
    replicas: list[Replica]
    data_dir: Path  # replica i's data directory is data_dir / str(i)
    admin: dict[str, str]
    redis_url: str
    redis_prefix: str

    def call(self, replica: Replica, method: str, path: str, body: Any = None,
             headers: dict[str, str] | None = None) -> httpx.Response:  # fmt: skip
        return httpx.request(method, replica.url + path, json=body, headers=headers or self.admin, timeout=60)

    def admin_call(self, replica: Replica, method: str, path: str, body: Any = None) -> Any:
        response = self.call(replica, method, "/admin/v1" + path, body)
        assert response.status_code < 300, response.text
        return response.json()

    def tenant(self, name: str, role: str = "member", policy: dict[str, Any] | None = None) -> tuple[str, str]:
        """A new tenant (through replica 1), a key of ``role`` in it (through replica 2), and its policy
        (through replica 3), then a wait until every replica has read the policy: (tenant id, key)."""
        first, second, third = self.replicas
        tenant = self.admin_call(first, "POST", "/tenants", {"name": name})
        key = self.admin_call(second, "POST", f"/tenants/{tenant['id']}/keys", {"name": "app", "role": role})["key"]
        if policy is not None:
            self.admin_call(third, "POST", f"/tenants/{tenant['id']}/policies", policy)
            time.sleep(4 * POLL_SECONDS)
        return tenant["id"], key

    def chain_of(self, replica: Replica) -> str:
        return spool_chain_id(self.spool_of(replica))

    def spool_of(self, replica: Replica) -> Path:
        return self.data_dir / str(self.replicas.index(replica) + 1) / "audit"


@pytest.fixture(scope="module")
def cluster(pg_server: str, redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("three-replicas")
    prefix = f"inferflux:rl:test-{secrets.token_hex(4)}"  # this module's counters only
    config = directory / "inferflux.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "auth": {"revocation_poll_seconds": POLL_SECONDS},
        "ratelimit": {"backend": "redis", "redis_url": redis_server, "redis_prefix": prefix},
        "audit": {"sink_linger_seconds": 0.1},  # the store's index follows the spools closely
    }))  # fmt: skip
    admin_key = generate_key().token
    with fresh_schema(pg_server) as url:
        env = {
            **os.environ,
            "INFERFLUX_STORE_URL": url,
            "INFERFLUX_STORE_PASSPHRASE": "correct horse battery staple",
            "INFERFLUX_BOOTSTRAP_ADMIN_KEY": admin_key,
        }
        with fleet(3, env, directory, ["--config", str(config)]) as replicas:
            yield Cluster(replicas, directory, bearer(admin_key), redis_server, prefix)
    client = redis.Redis.from_url(redis_server)
    try:
        for name in client.scan_iter(match=f"{prefix}:*"):
            client.delete(name)
    finally:
        client.close()


def spread(cluster: Cluster, count: int, body: dict[str, Any], key: str, start: int = 0) -> list[httpx.Response]:
    """``count`` completions sent at once, request i through replica (start + i) mod 3.

    All at once, so that every limiter decision is taken in the first moments (an
    admitted request then waits for the engine, a refused one is answered at once).
    """

    def send(i: int) -> httpx.Response:
        replica = cluster.replicas[(start + i) % len(cluster.replicas)]
        return cluster.call(replica, "POST", "/v1/completions", body, bearer(key))

    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(send, range(count)))


def refusal_codes(responses: list[httpx.Response]) -> set[str]:
    return {r.json()["error"]["code"] for r in responses if r.status_code != 200}


# -- limits ----------------------------------------------------------------------------


def test_a_request_rate_limit_holds_across_three_replicas(cluster: Cluster) -> None:
    """Three times the limit at once, round-robin: accepted within 5 % of the limit.

    One replica alone admits exactly the limit of a burst decided within the window (a
    minute, counted up to a bucket long): the requests all go out at once, so the
    decisions take a moment however long the admitted ones then take to generate.
    With per-replica (in-process) counters, three replicas would admit up to three times it.
    """
    limit = 20
    _, key = cluster.tenant("rated", policy={
        "kind": "rate_limit", "name": "rpm", "spec": {"scope": "tenant", "requests_per_minute": limit},
    })  # fmt: skip
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    responses = spread(cluster, 3 * limit, body, key)
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, [r.text for r in responses if r.status_code not in (200, 429)]
    assert refusal_codes(responses) <= {"rate_limit_exceeded"}
    accepted = codes.count(200)
    last = max((r.elapsed.total_seconds() for r in responses if r.status_code == 429), default=None)
    print(f"\n{accepted} of {len(codes)} accepted with a limit of {limit} requests per minute; the last refusal "
          f"after {last} s")
    assert abs(accepted - limit) <= TOLERANCE * limit, f"{accepted} accepted with a limit of {limit}"
    # The limit was shared: each replica was sent exactly the limit, so counters of their own
    # would have admitted every request (three times the limit, refused by the check above),
    # and more than one replica refused. Which replica admitted how many depends on arrival
    # order (one that decides late may admit none), so it is printed, not asserted.
    admitted = {replica.name: codes[i::3].count(200) for i, replica in enumerate(cluster.replicas)}
    print(f"admitted by replica: {admitted}")
    refusing = [replica.name for i, replica in enumerate(cluster.replicas) if 429 in codes[i::3]]
    assert len(refusing) >= 2, (admitted, refusing)


def test_a_token_quota_holds_and_settles_across_three_replicas(cluster: Cluster) -> None:
    """A daily token quota drained round-robin over three replicas, a few requests in flight at once.

    Each request reserves its estimate (prompt + max_tokens) and is settled to its real
    count by the replica that admitted it (the stop string ends it early). Rounds are sent
    until one is refused whole with nothing in flight, so the quota is spent as far as one
    replica alone, taking the same requests one by one, would spend it: the counter equals
    the tokens the answers report, never passes the quota, and is short of it by less than
    one request's estimate; the requests admitted are within 5 % of one replica's count
    (every request costs the same, so that count is exact). A reservation left unsettled,
    or settled on a counter of its own replica, would leave the counter above what the
    answers report, and a quarter fewer requests admitted.
    """
    quota, max_tokens = 150, 4
    tenant_id, key = cluster.tenant("metered", policy={
        "kind": "quota", "name": "daily", "spec": {"scope": "tenant", "period": "day", "tokens": quota},
    })  # fmt: skip
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0,
            "stop": ["."]}  # fmt: skip
    answered: list[httpx.Response] = []
    for round_number in range(30):
        batch = spread(cluster, 9, body, key, start=round_number)
        answered += batch
        assert {r.status_code for r in batch} <= {200, 429}, [r.text for r in batch]
        if all(r.status_code == 429 for r in batch):
            break
        time.sleep(0.2)  # settlements run just after each answer, off the request path
    else:
        raise AssertionError("the quota was not spent after 30 rounds")
    assert refusal_codes(answered) == {"insufficient_quota"}

    admitted = [r.json()["usage"] for r in answered if r.status_code == 200]
    charged = sum(u["total_tokens"] for u in admitted)
    estimate = admitted[0]["prompt_tokens"] + max_tokens
    costs = {u["total_tokens"] for u in admitted}
    assert max(costs) < estimate, f"the stop string did not end the requests early: {costs}, estimate {estimate}"
    print(f"\n{len(admitted)} admitted, {charged} tokens charged of a quota of {quota}; "
          f"estimate {estimate}, real {sorted(costs)}")  # fmt: skip
    # One replica alone, taking them one by one: admit while the counter plus an estimate fits.
    assert len(costs) == 1, f"greedy requests of one prompt cost {costs}"
    alone = (quota - estimate) // next(iter(costs)) + 1
    assert abs(len(admitted) - alone) <= TOLERANCE * alone, f"{len(admitted)} admitted, one replica: {alone}"
    assert quota - estimate < charged <= quota
    assert quota_counter(cluster, tenant_id) == charged, "the counter is not the sum of the settled requests"


def quota_counter(cluster: Cluster, tenant_id: str) -> int:
    """The tenant's quota counter in Redis (``policy.ratelimit``'s key: {tenant}:t:quota:<day>)."""
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        names = list(client.scan_iter(match=f"{cluster.redis_prefix}:{{{tenant_id}}}:t:quota:*"))
        assert len(names) == 1, names
        return int(client.get(names[0]) or 0)
    finally:
        client.close()


# -- audit -----------------------------------------------------------------------------


def test_one_audit_query_shows_every_replicas_events_in_time_order(cluster: Cluster) -> None:
    first, second, third = cluster.replicas
    acme, acme_key = cluster.tenant("acme-audit")
    globex, globex_key = cluster.tenant("globex-audit")
    acme_admin = bearer(cluster.admin_call(first, "POST", f"/tenants/{acme}/keys",
                                           {"name": "admin", "role": "tenant-admin"})["key"])  # fmt: skip
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))
    sent: dict[str, tuple[Replica, str]] = {}  # request id -> (replica, tenant)
    for replica in cluster.replicas:
        for tenant_id, key in ((acme, acme_key), (globex, globex_key)):
            request_id = f"req-{secrets.token_hex(6)}"
            headers = {**bearer(key), "x-request-id": request_id}
            assert cluster.call(replica, "GET", "/v1/models", headers=headers).status_code == 200
            sent[request_id] = (replica, tenant_id)
    chains = {replica.name: cluster.chain_of(replica) for replica in cluster.replicas}
    assert len(set(chains.values())) == 3, chains

    # A platform admin's one query, on replica 2, shows the calls made through all three.
    items = wait_for_events(lambda: audit(cluster, second, cluster.admin, since), set(sent))
    mine = [item for item in items if item["request_id"] in sent]
    assert len(mine) == len(sent)
    for item in mine:
        replica, tenant_id = sent[item["request_id"]]
        assert item["chain"] == chains[replica.name] and item["tenant_id"] == tenant_id, item
    assert [item["at"] for item in items] == sorted(item["at"] for item in items), "not in time order"

    # A tenant admin of acme, on replica 3, sees acme's calls through every replica and nothing of globex.
    acme_sent = {rid for rid, (_, tenant_id) in sent.items() if tenant_id == acme}
    scoped = wait_for_events(lambda: audit(cluster, third, acme_admin, since), acme_sent)
    assert {item["tenant_id"] for item in scoped} == {acme}
    assert {item["chain"] for item in scoped if item["request_id"] in acme_sent} == set(chains.values())
    assert cluster.call(third, "GET", f"/admin/v1/audit?tenant_id={globex}", headers=acme_admin).status_code == 404

    # Tamper evidence holds per replica: each item is its record as chained, and each spool verifies.
    for item in mine:
        replica, _ = sent[item["request_id"]]
        record = {name: item[name] for name in ("chain", "seq", "prev", "hash")}
        event = {name: value for name, value in item.items() if name not in (*record, "object")}
        parse_record(json.dumps({**record, "event": event, "v": 1}))  # raises if the hash does not match
        assert spooled_hashes(cluster.spool_of(replica))[item["seq"]] == item["hash"]
    for replica in cluster.replicas:
        report = verify_spool(cluster.spool_of(replica))
        assert report.ok and [c.chain for c in report.chains] == [chains[replica.name]], report


def audit(cluster: Cluster, replica: Replica, headers: dict[str, str], since: str) -> list[dict[str, Any]]:
    """Every api event since ``since`` as ``replica`` answers, page after page."""
    items: list[dict[str, Any]] = []
    params: dict[str, Any] = {"kind": "api", "since": since, "limit": 100}
    while True:
        response = httpx.get(replica.url + "/admin/v1/audit", params=params, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        page = response.json()
        items += page["data"]
        if page["next_cursor"] is None:
            return items
        params["after"] = page["next_cursor"]


def wait_for_events(query: Callable[[], list[dict[str, Any]]], request_ids: set[str]) -> list[dict[str, Any]]:
    """``query``'s answer once it holds every event of ``request_ids`` (indexing lags a little)."""
    deadline = time.monotonic() + 30
    while True:
        items = query()
        missing = request_ids - {item["request_id"] for item in items}
        if not missing:
            return items
        assert time.monotonic() < deadline, f"events of {sorted(missing)} not queryable after 30 s"
        time.sleep(0.2)


def spooled_hashes(spool: Path) -> dict[int, str]:
    """seq -> hash of every record in a replica's spool."""
    out = {}
    for segment in segment_files(spool):
        for line in segment.read_text().splitlines():
            if line:
                record = json.loads(line)
                out[record["seq"]] = record["hash"]
    return out


# -- the model registry -------------------------------------------------------------------

REGISTRY_BOUND_SECONDS = 2.0  # from a change in the store to every replica acting on it (model_registry.poll_seconds: 1)
LOAD_TIMEOUT = 180.0


def model_state(cluster: Cluster, replica: Replica, name: str) -> str:
    """The model's status on ``replica``: loading, ready, failed, or 'absent'."""
    response = cluster.call(replica, "GET", f"/admin/v1/models/{name}")
    return str(response.json()["status"]) if response.status_code == 200 else "absent"


def served_models(cluster: Cluster, replica: Replica) -> list[str]:
    return [m["id"] for m in cluster.call(replica, "GET", "/v1/models").json()["data"]]


def default_model(cluster: Cluster, replica: Replica) -> str:
    listed = cluster.call(replica, "GET", "/admin/v1/models").json()["data"]
    return next(m["id"] for m in listed if m.get("default"))


def seconds_until_each(
    replicas: list[Replica], check: Callable[[Replica], bool], timeout: float, start: float | None = None
) -> dict[str, float]:
    """How long from ``start`` (default: now) until ``check`` holds on each replica (fails past ``timeout``)."""
    start = time.monotonic() if start is None else start
    took: dict[str, float] = {}
    while len(took) < len(replicas):
        for replica in replicas:
            if replica.name not in took and check(replica):
                took[replica.name] = time.monotonic() - start
        elapsed = time.monotonic() - start
        pending = [r.name for r in replicas if r.name not in took]
        if pending and elapsed > timeout:
            raise AssertionError(f"{pending} not there after {elapsed:.1f} s")
        time.sleep(0.05)
    return took


def test_a_model_loaded_defaulted_and_unloaded_through_one_replica_reaches_the_others(cluster: Cluster) -> None:
    first, second, third = cluster.replicas
    assert all(served_models(cluster, r) == [MODEL] for r in cluster.replicas)
    body = {"name": "extra", "path": default_model_path(), "dtype": "float32", "aliases": ["extra-alias"]}
    started = time.monotonic()
    assert cluster.call(first, "POST", "/admin/v1/models", body).status_code == 202
    seconds_until_each([first], lambda r: model_state(cluster, r, "extra") != "loading", LOAD_TIMEOUT)
    assert model_state(cluster, first, "extra") == "ready"
    registered = time.monotonic()  # in the store: replica 1 records a model once it is ready

    # The others take it up (start loading) within the bound, and serve it once loaded.
    others = [second, third]
    taken_up = seconds_until_each(
        others, lambda r: model_state(cluster, r, "extra") in ("loading", "ready"), 2 * REGISTRY_BOUND_SECONDS
    )
    serving = seconds_until_each(others, lambda r: "extra" in served_models(cluster, r), LOAD_TIMEOUT, start=registered)
    print(f"\nload on replica 1 alone: {registered - started:.2f} s; after that, taken up by the others in "
          f"{taken_up} s, served by them (both loading at once) in {serving} s")
    assert max(taken_up.values()) <= REGISTRY_BOUND_SECONDS, taken_up
    for replica in others:
        chat = {"model": "extra-alias", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        answer = cluster.call(replica, "POST", "/v1/chat/completions", chat)
        assert answer.status_code == 200 and answer.json()["model"] == "extra", (replica.name, answer.text)
    assert served_models(cluster, first).count("extra") == 1  # replica 1 did not load its own model twice

    # A default set through replica 2 moves every replica's.
    assert cluster.call(second, "POST", "/admin/v1/models/extra/default").status_code == 200
    took = seconds_until_each([first, third], lambda r: default_model(cluster, r) == "extra", 2 * REGISTRY_BOUND_SECONDS)
    assert max(took.values()) <= REGISTRY_BOUND_SECONDS, took

    # An unload through replica 3 leaves every replica; the configured model stays, and is the default again.
    assert cluster.call(third, "DELETE", "/admin/v1/models/extra").status_code == 204
    took = seconds_until_each([first, second], lambda r: "extra" not in served_models(cluster, r), 2 * REGISTRY_BOUND_SECONDS)
    assert max(took.values()) <= REGISTRY_BOUND_SECONDS, took
    for replica in (first, second, third):
        assert served_models(cluster, replica) == [MODEL] and default_model(cluster, replica) == MODEL
