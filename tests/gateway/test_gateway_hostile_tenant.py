"""Acceptance: a hostile tenant cannot affect another (issue 18), end to end over a real socket.

acme's tenant admin and member go through every admin route with globex's ids and hostile
bodies, every tenant route with hostile input, change everything acme may change about
itself (guardrails that block common words, a limit it then runs into, its identity
provider), and flood the engine. globex is watched throughout:

* what globex sees — its tenant, keys, bindings, providers, limits, guardrails, model list,
  its models and a greedy generation on both routes — is the same after the attack as before;
* no answer to acme was a 5xx, and nothing in globex's audit trail names acme's principals;
* under acme's flood globex's requests are served ahead of acme's queue: the fairness bound,
  asserted on the order requests are served in (as tests/gateway/test_gateway_fairness.py
  does), since speed is measured in benchmarks/bench_fairness.py, not in timed tests.

The engine seats ``SEATS`` sequences so that acme's flood really queues.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from admin_seed import Seeded, seed_store
from inferflux.gateway.routes import admin
from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from http_helpers import bearer
from servers import start_uvicorn, stop_uvicorn
from streams import SEATS, first_token_at

MODEL = DEFAULT_MODEL_NAME
PREFIX = "/admin/v1"
POLL = 0.05  # the app's revocation/policy poll: acme's own changes take effect at once
FLOOD = 24
# Volatile fields: ids and times of answers, and a key's last use (globex's own calls move it).
VOLATILE = {"id", "created", "system_fingerprint", "last_used_at"}


@dataclass
class World(Seeded):
    url: str
    globex_member: str  # a member key of globex
    ids: dict[str, str]  # path parameter -> a globex object's id


@pytest.fixture(scope="module")
def world(small_batch_model: Any, app_for_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    data_dir = tmp_path_factory.mktemp("hostile")
    seeded = seed_store(data_dir)
    store, globex = seeded.store, seeded.globex
    member, member_key = store.create_api_key(globex.id, "app", "member")
    binding = store.create_role_binding(globex.id, provider_id=seeded.provider.id, kind="group", subject="staff",
                                        role="member")  # fmt: skip
    provider = store.create_oidc_provider("sso", "https://globex-sso.example.com", "inferflux", tenant_id=globex.id)
    limit = store.create_policy(globex.id, "rate_limit", "roomy", {"requests_per_minute": 10**6})
    guardrail = store.create_policy(globex.id, "guardrail", "words", {"blocklist": [{"id": "w", "literal": "zzq"}]})
    upstream = store.create_credential(None, "fleet", "sk-platform-upstream")  # the platform's: no tenant reaches it
    ids = {"tenant_id": globex.id, "key_id": member.id, "binding_id": binding.id, "provider_id": provider.id,
           "policy_id": guardrail.id, "name": MODEL, "model": MODEL, "limit_id": limit.id,
           "credential_id": upstream.id}  # fmt: skip
    app = app_for_model(small_batch_model, store, data_dir=str(data_dir / "app"),
                        auth={"revocation_poll_seconds": POLL})  # fmt: skip
    server, thread, sock, url = start_uvicorn(app)
    try:
        yield World(**seeded.seeded(), url=url, globex_member=member_key, ids=ids)
    finally:
        stop_uvicorn(server, thread, sock)
        store.close()


def stable(value: Any) -> Any:
    """``value`` without the fields that change between two identical calls."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def globex_view(world: World) -> dict[str, Any]:
    """Everything globex's admin and member see of their tenant, and two greedy generations."""
    g = world.ids["tenant_id"]
    admin_reads = [f"/tenants/{g}", f"/tenants/{g}/keys", f"/tenants/{g}/keys/{world.ids['key_id']}",
                   f"/tenants/{g}/role-bindings", f"/tenants/{g}/models", f"/tenants/{g}/policies",
                   f"/tenants/{g}/policies/{world.ids['limit_id']}", "/oidc-providers",
                   f"/oidc-providers/{world.ids['provider_id']}", "/guardrails",
                   f"/guardrails/{world.ids['policy_id']}", "/whoami"]  # fmt: skip
    member = bearer(world.globex_member)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    completion = {"model": MODEL, "prompt": "The sky is", "max_tokens": 8, "temperature": 0}
    view: dict[str, Any] = {}
    with httpx.Client(base_url=world.url, timeout=120) as client:
        for path in admin_reads:
            answer = client.get(PREFIX + path, headers=world.globex_admin)
            view[path] = (answer.status_code, stable(answer.json()))
        for path in ("/v1/models", f"/v1/models/{MODEL}"):
            answer = client.get(path, headers=member)
            view[path] = (answer.status_code, stable(answer.json()))
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
            answer = client.post(path, json=body, headers=member)
            view[path] = (answer.status_code, stable(answer.json()))
    return view


# -- the attacks ------------------------------------------------------------------------------

def declared_admin_routes() -> list[tuple[str, str]]:
    return sorted((m, r.path) for r in admin.routes() if isinstance(r, Route) for m in r.methods or () if m != "HEAD")


def hostile_bodies(world: World) -> list[dict[str, Any]]:
    """Bodies that would hurt globex if any route took them: its tenant named, disabled, escalated."""
    g = world.ids["tenant_id"]
    return [
        {"tenant_id": g, "disabled": True, "name": "pwned", "role": "platform-admin",
         "allowed_models": [], "models": [], "enabled": False},
        {"tenant_id": g, "kind": "rate_limit", "name": "choke", "spec": {"requests_per_minute": 1}},
        {"tenant_id": g, "name": "block", "spec": {"blocklist": [{"id": "all", "regex": ".+"}]}},
        {"tenant_id": g, "name": "idp", "issuer": "https://evil.example.com", "audience": "inferflux",
         "tenant_ids": [g], "allow_platform": True, "role_map": {"admin": "platform-admin"}},
    ]  # fmt: skip


def admin_attacks(world: World) -> Iterator[tuple[str, str, Any]]:
    """(method, url, body) for every admin route naming globex's objects, with each hostile body."""
    g = world.ids["tenant_id"]
    for method, template in declared_admin_routes():
        url = template
        for name in Route(template, lambda r: None).param_convertors:
            value = world.ids["limit_id"] if name == "policy_id" and "/tenants/" in template else world.ids[name]
            url = url.replace(f"{{{name}}}", value)
        if "{tenant_id}" not in template and method in ("GET", "DELETE", "PATCH"):
            url += f"?tenant_id={g}"
        if template.endswith("/audit/stream"):
            url += "&max_seconds=1"
        if method in ("POST", "PUT", "PATCH"):
            for body in hostile_bodies(world):
                yield method, url, body
        else:
            yield method, url, None


def tenant_attacks(world: World) -> list[tuple[str, Any]]:
    """Generation requests with every hostile field an acme caller could send."""
    g = world.ids["tenant_id"]
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return [
        ("/v1/chat/completions", {**base, "tenant_id": g, "user": g}),
        ("/v1/chat/completions", {**base, "priority": -1000}),
        ("/v1/chat/completions", {**base, "priority": 10**40}),
        ("/v1/chat/completions", {**base, "stop": ["x"] * 10_000}),
        ("/v1/chat/completions", {**base, "stop": "y" * 1_000_000}),
        ("/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "\ud800"}]}),
        ("/v1/chat/completions", {**base, "max_tokens": 10**30}),
        ("/v1/chat/completions", {**base, "model": "../" + MODEL}),
        ("/v1/completions", {"model": MODEL, "prompt": [[1] * 100_000], "max_tokens": 1}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 10**6}),
    ]


def send_raw(client: httpx.Client, method: str, url: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    content = None if body is None else json.dumps(body).encode()  # ensure_ascii: "\ud800" travels escaped
    return client.request(method, url, content=content, headers={**headers, "content-type": "application/json"})


def flood_and_watch(world: World, acme_key: str, engine: Any) -> list[tuple[int, int]]:
    """acme floods; globex sends one request at a time while acme's are queued.

    Per globex request: (acme's requests not yet served when it was sent, how many of those were
    served before it)."""

    async def scenario() -> list[tuple[int, int]]:
        stamps: dict[str, float] = {}
        overtaken: list[tuple[int, int]] = []
        limits = httpx.Limits(max_connections=FLOOD + 4)
        async with httpx.AsyncClient(base_url=world.url, timeout=180, limits=limits) as client:
            flood = [asyncio.ensure_future(first_token_at(client, acme_key, 16, stamps, f"a{i}")) for i in range(FLOOD)]
            deadline = time.monotonic() + 90
            while engine.stats().num_waiting < 2 * SEATS:
                assert time.monotonic() < deadline, "acme's flood never queued"
                await asyncio.sleep(0.01)
            for b in range(2):
                if engine.stats().num_waiting < 2 * SEATS:
                    break
                queued = {f"a{i}" for i in range(FLOOD)} - set(stamps)
                await first_token_at(client, world.globex_member, 2, stamps, f"b{b}")
                served_first = sum(1 for a in queued if a in stamps and stamps[a] < stamps[f"b{b}"])
                overtaken.append((len(queued), served_first))
            await asyncio.gather(*flood)
        return overtaken

    return asyncio.run(scenario())


def test_a_hostile_tenant_cannot_affect_another(world: World, small_batch_model: Any) -> None:
    before = globex_view(world)
    assert all(status == 200 for status, _ in before.values()), before
    acme = world.acme.id
    acme_member_key = world.store.create_api_key(acme, "flood", "member")[1]
    callers = {"acme tenant-admin": world.acme_admin, "acme member": bearer(acme_member_key)}

    refused: list[tuple[str, str, str, int]] = []
    with httpx.Client(base_url=world.url, timeout=120) as client:
        for who, headers in callers.items():
            for method, url, body in admin_attacks(world):
                answer = send_raw(client, method, url, body, headers)
                assert answer.status_code < 500, (who, method, url, answer.text)
                assert answer.status_code in (400, 403, 404, 422), (who, method, url, answer.status_code, answer.text)
                refused.append((who, method, url, answer.status_code))
            for path, body in tenant_attacks(world):
                answer = send_raw(client, "POST", path, body, headers)
                assert answer.status_code < 500, (who, path, answer.text)
                if "tenant_id" not in body:
                    assert 400 <= answer.status_code < 500, (who, path, answer.status_code)
        assert globex_view(world) == before, "a refused request changed what globex sees"

        # Under acme's flood, globex is served ahead of acme's queue (the fairness bound).
        overtaken = flood_and_watch(world, acme_member_key, small_batch_model.engine)
        assert overtaken, "acme's flood was served before globex could be measured"
        for queued, served_first in overtaken:
            # FIFO would serve all of acme's queue first; one batch's worth may start while globex's
            # request crosses the gateway (the bound of test_gateway_fairness.py)
            assert queued >= 2 * SEATS and served_first <= SEATS, overtaken

        # Everything acme may do to itself (words globex uses blocked, its own identity provider under
        # globex's issuer), and the operator choking acme (tenant admins read their limits, never write them).
        own = {"name": "mine", "spec": {"blocklist": [{"id": "c", "literal": "colour"}, {"id": "s", "regex": "sky"}]}}
        assert client.post(f"{PREFIX}/guardrails", json=own, headers=world.acme_admin).status_code == 201
        choke = {"kind": "rate_limit", "name": "choke", "spec": {"requests_per_minute": 1, "min_priority": 0}}
        assert client.post(f"{PREFIX}/tenants/{acme}/policies", json=choke, headers=world.admin).status_code == 201
        idp = {"name": "acme-sso", "issuer": "https://globex-sso.example.com", "audience": "acme-app"}
        assert client.post(f"{PREFIX}/oidc-providers", json=idp, headers=world.acme_admin).status_code == 201
        time.sleep(5 * POLL)
        for _ in range(3):  # acme now runs into its own limit; globex must not
            send_raw(client, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1},
                     callers["acme member"])  # fmt: skip

        # globex's own audit trail names nothing of acme's.
        trail = client.get(f"{PREFIX}/audit?limit=100", headers=world.globex_admin)
        assert trail.status_code == 200, trail.text
        for event in trail.json()["data"]:
            assert acme not in json.dumps(event), event

    after = globex_view(world)
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after.get(k)}
    assert len(refused) > 2 * len(declared_admin_routes())
