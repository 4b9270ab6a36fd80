"""The traffic policy on the request path: rate limits and quotas with real token counts,
guardrails on input and output (streams included), OPA, and one audit event per call.

Policies are written to the store directly (the admin API has its own tests) and
take effect without a restart; every app here runs on the real session model.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from app_world import AppWorld, open_world, wait_until
from audit_support import make_event
from inferflux.gateway.settings import DEFAULT_MODEL_NAME, Settings
from inferflux.gateway.traffic import TrafficPolicy
from http_helpers import bearer, error_of
from inferflux.policy.audit import ChainConflict, Cursor, Spool, verify_spool
from inferflux.policy.store import PolicyStore, StoreSettings

MODEL = DEFAULT_MODEL_NAME
POLL = 0.05  # the apps here re-read policies this often


class World(AppWorld):
    def policies_seen(self) -> None:
        time.sleep(3 * POLL)  # longer than the resolvers' poll interval


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    data_dir = tmp_path_factory.mktemp("traffic")
    with open_world(World, make_app, data_dir, auth={"revocation_poll_seconds": POLL}) as world:
        yield world


def chat(world: World, key: str, content: str, **extra: Any) -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0,
            **extra}
    return world.client.post("/v1/chat/completions", json=body, headers=bearer(key))


def stream_chat(world: World, key: str, content: str, **extra: Any) -> tuple[str, str | None, dict[str, Any]]:
    """(text, finish_reason, usage) of a streamed chat completion."""
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": content}], "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0, **extra,
    }
    text, finish, usage = "", None, {}
    with world.client.stream("POST", "/v1/chat/completions", json=body, headers=bearer(key)) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return text, finish, usage


# -- rate limits and quotas ---------------------------------------------------------------


def test_requests_per_minute_gives_429_with_headers(world: World) -> None:
    tenant, key = world.tenant_key()
    world.store.create_policy(tenant.id, "rate_limit", "rpm", {"scope": "tenant", "requests_per_minute": 2})
    world.policies_seen()
    for _ in range(2):
        ok = chat(world, key, "hi")
        assert ok.status_code == 200, ok.text
        assert ok.headers["x-ratelimit-limit-requests"] == "2"
    world.settled()
    refused = chat(world, key, "hi")
    assert refused.status_code == 429
    assert error_of(refused)["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    # Another tenant is not affected.
    _, other = world.tenant_key()
    assert chat(world, other, "hi").status_code == 200


def short_stream(world: World, key: str) -> tuple[str, int, int]:
    """A stream that stops after a few of its 40 allowed tokens: (its stop word, prompt tokens, real total)."""
    # Learn how long the prompt is and what the model says, with no limits yet.
    text, _, usage = stream_chat(world, key, "Name a colour.", max_tokens=16)
    words = text.split()
    assert words, text
    # Stopping at the first word ends the stream after a few tokens, far fewer than max_tokens.
    _, finish, short = stream_chat(world, key, "Name a colour.", max_tokens=40, stop=[words[0]])
    assert finish == "stop" and short["completion_tokens"] < 40
    world.settled()
    return words[0], usage["prompt_tokens"], short["prompt_tokens"] + short["completion_tokens"]


def test_tokens_are_settled_with_the_real_count_of_a_stream(world: World) -> None:
    tenant, key = world.tenant_key()
    word, prompt, real = short_stream(world, key)
    # Room for one such request settled at its real count plus one reserved at its
    # estimate (prompt + max_tokens), but not for two estimates.
    limit = real + prompt + 40
    world.store.create_policy(tenant.id, "rate_limit", "tpm", {"scope": "tenant", "tokens_per_minute": limit})
    world.policies_seen()
    stream_chat(world, key, "Name a colour.", max_tokens=40, stop=[word])
    world.settled()
    second = chat(world, key, "Name a colour.", max_tokens=40, stop=[word])
    assert second.status_code == 200, second.text  # fits only because the first was settled at its real count
    world.settled()
    third = chat(world, key, "Name a colour.", max_tokens=40)
    assert third.status_code == 429 and error_of(third)["type"] == "tokens"


def test_a_token_quota_refuses_once_spent(world: World) -> None:
    tenant, key = world.tenant_key()
    first = chat(world, key, "hello", max_tokens=8)
    spent = first.json()["usage"]["total_tokens"]
    world.settled()
    world.store.create_policy(tenant.id, "quota", "daily", {"scope": "tenant", "period": "day", "tokens": spent + 20})
    world.policies_seen()
    assert chat(world, key, "hello", max_tokens=8).status_code == 200
    world.settled()
    refused = chat(world, key, "hello", max_tokens=8)
    assert refused.status_code == 429 and error_of(refused)["code"] == "insufficient_quota"



def test_a_quota_is_charged_the_real_count_of_a_stream(world: World) -> None:
    tenant, key = world.tenant_key()
    word, prompt, real = short_stream(world, key)
    # The quota is counted from when it is created: room for the stream at its real
    # count and one more request at its estimate, not for two estimates.
    world.store.create_policy(tenant.id, "quota", "daily", {"scope": "tenant", "period": "day",
                                                             "tokens": real + prompt + 40})
    world.policies_seen()
    stream_chat(world, key, "Name a colour.", max_tokens=40, stop=[word])
    world.settled()
    second = chat(world, key, "Name a colour.", max_tokens=40, stop=[word])
    assert second.status_code == 200, second.text  # fits only because the stream was charged its real count
    world.settled()
    third = chat(world, key, "Name a colour.", max_tokens=40)
    assert third.status_code == 429 and error_of(third)["code"] == "insufficient_quota"


def test_tenants_do_not_share_the_prefix_cache(world: World) -> None:
    (_, key_a), (_, key_b) = world.tenant_key(), world.tenant_key()
    engine = world.app.state.manager.get(MODEL).engine
    content = "Summarise the rules of chess for a beginner, covering how each piece moves, in detail. " * 3

    def hits_after(key: str) -> int:
        before = engine.stats().prefix_cache_hit_tokens
        assert chat(world, key, content, max_tokens=1).status_code == 200
        wait_until(lambda: engine.stats().num_running == 0)
        return engine.stats().prefix_cache_hit_tokens - before

    assert hits_after(key_a) == 0
    assert hits_after(key_b) == 0  # the same prompt, another tenant: nothing reused
    assert hits_after(key_a) >= 48  # the same tenant again: its full blocks are reused

# -- guardrails and OPA -------------------------------------------------------------------


def test_a_blocklisted_word_is_refused_even_obfuscated(world: World) -> None:
    tenant, key = world.tenant_key()
    world.store.create_policy(tenant.id, "guardrail", "words", {"blocklist": [{"id": "no-ski", "literal": "ski"}]})
    world.policies_seen()
    for content in ("Let's go ski", "Let's go ＳＫＩ", "Let's go s\u200bki"):
        refused = chat(world, key, content)
        assert refused.status_code == 400, content
        error = error_of(refused)
        assert error["code"] == "content_filter" and "ski" not in error["message"].lower().replace("no-ski", "")
    assert chat(world, key, "Let's go skiing").status_code == 200  # a word of its own


def test_output_guardrails_end_a_stream_with_content_filter(world: World) -> None:
    tenant, key = world.tenant_key()
    text, finish, _ = stream_chat(world, key, "Write one sentence about the sea.", max_tokens=24)
    assert finish == "length"
    word = next(w.strip(".,!?") for w in text.split()[2:] if len(w.strip(".,!?")) > 3)
    world.store.create_policy(
        tenant.id, "guardrail", "out", {"blocklist": [{"id": "w", "literal": word, "direction": "output"}]}
    )
    world.policies_seen()
    filtered, finish, usage = stream_chat(world, key, "Write one sentence about the sea.", max_tokens=24)
    assert finish == "content_filter"
    assert word.lower() not in filtered.lower()
    assert filtered == text[: len(filtered)]  # what was let out is the unfiltered text's beginning
    # Not streamed: the same cut, in one answer.
    whole = chat(world, key, "Write one sentence about the sea.", max_tokens=24).json()
    assert whole["choices"][0]["finish_reason"] == "content_filter"


def test_opa_denies_with_reasons_and_an_edit_takes_effect(world: World) -> None:
    tenant, key = world.tenant_key()
    rego = (
        "package inferflux.guardrails\n"
        "default decision := {\"allow\": true}\n"
        "decision := {\"allow\": false, \"reasons\": [\"prompt too long for this tenant\"]} "
        "if { input.tokens.prompt > LIMIT }\n"
    )
    policy = world.store.create_policy(
        tenant.id, "guardrail", "opa", {"opa": {"engine": "embedded", "rego": rego.replace("LIMIT", "5")}}
    )
    world.policies_seen()
    denied = chat(world, key, "a question that is longer than five tokens, surely")
    assert denied.status_code == 403
    assert "prompt too long for this tenant" in error_of(denied)["message"]
    world.store.update_policy(tenant.id, policy.id, spec={"opa": {"engine": "embedded", "rego": rego.replace("LIMIT", "5000")}})
    world.policies_seen()
    assert chat(world, key, "a question that is longer than five tokens, surely").status_code == 200


# Denies one-token completions after ~0.5 s of work, far longer than the engine
# takes to answer one; allows everything else at once.
SLOW_DENY = """package inferflux.guardrails
import rego.v1
slow if count([x | some x in numbers.range(1, 200000); x % 7 == 0]) > 0
default decision := {"allow": true}
decision := {"allow": false, "reasons": ["one-token completions are not allowed"]} if {
    input.tokens.max_completion == 1
    slow
}
"""


def test_a_policy_slower_than_the_engine_still_decides_before_any_output(world: World) -> None:
    # The engine starts while the policy evaluates: a deny that comes after the
    # engine's answer must still be all the client sees, stream or not, and the
    # refused requests' reserved tokens go back to the tenant.
    limits = {"scope": "tenant", "requests_per_minute": 100, "tokens_per_minute": 100_000}
    (tenant, key), (baseline, baseline_key) = world.tenant_key(), world.tenant_key()
    for tenant_id in (tenant.id, baseline.id):
        world.store.create_policy(tenant_id, "rate_limit", "limits", limits)
    world.store.create_policy(
        tenant.id, "guardrail", "slow", {"opa": {"engine": "embedded", "rego": SLOW_DENY, "timeout_ms": 10_000}}
    )
    world.policies_seen()
    denied = chat(world, key, "hi", max_tokens=1)
    assert denied.status_code == 403, denied.text
    assert "one-token completions are not allowed" in error_of(denied)["message"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True}
    with world.client.stream("POST", "/v1/chat/completions", json=body, headers=bearer(key)) as response:
        streamed = response.read()
    assert response.status_code == 403 and b"data:" not in streamed, streamed
    engine = world.app.state.manager.get(MODEL).engine
    wait_until(lambda: engine.stats().num_running == 0 and engine.stats().num_waiting == 0)  # nothing left running
    world.settled()
    allowed, fresh = chat(world, key, "hi", max_tokens=2), chat(world, baseline_key, "hi", max_tokens=2)
    assert allowed.status_code == fresh.status_code == 200, allowed.text
    # Each refused request counted once; none of their tokens did.
    assert int(allowed.headers["x-ratelimit-remaining-requests"]) == int(fresh.headers["x-ratelimit-remaining-requests"]) - 2
    assert allowed.headers["x-ratelimit-remaining-tokens"] == fresh.headers["x-ratelimit-remaining-tokens"]


# The operator's policy: no one-token completions for one tenant (named below); the rest is allowed.
GLOBAL_DENY = """package inferflux.guardrails
default decision := {"allow": true}
decision := {"allow": false, "reasons": ["one-token completions are closed to this tenant"]} if {
    input.tenant.name == "TENANT"
    input.tokens.max_completion == 1
}
"""


def test_a_global_policy_decides_inline_before_the_engine_gets_the_request(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    limits = {"scope": "tenant", "requests_per_minute": 100, "tokens_per_minute": 100_000}
    (tenant, key), (baseline, baseline_key) = world.tenant_key(), world.tenant_key()
    for tenant_id in (tenant.id, baseline.id):
        world.store.create_policy(tenant_id, "rate_limit", "limits", limits)
    engine = world.app.state.manager.get(MODEL).engine
    calls: list[int] = []
    stream = engine.stream  # what the gateway runs a checked request with
    monkeypatch.setattr(engine, "stream", lambda *a, **k: (calls.append(1), stream(*a, **k))[1])
    spec = {"opa": {"engine": "embedded", "rego": GLOBAL_DENY.replace("TENANT", tenant.name)}}
    policy = world.store.create_policy(None, "guardrail", "closed", spec)
    try:
        world.policies_seen()
        assert [engine.inline for engine in world.app.state.guardrails.get(tenant.id).engines] == [True]
        denied = chat(world, key, "hi", max_tokens=1)
        assert denied.status_code == 403 and "closed to this tenant" in error_of(denied)["message"]
        assert calls == []  # refused before the engine got it
        world.settled()
        allowed, fresh = chat(world, key, "hi", max_tokens=2), chat(world, baseline_key, "hi", max_tokens=2)
        assert allowed.status_code == fresh.status_code == 200 and calls == [1, 1]
        # The refused request counted once; none of its reserved tokens did.
        remaining = "x-ratelimit-remaining-requests"
        assert int(allowed.headers[remaining]) == int(fresh.headers[remaining]) - 1
        assert allowed.headers["x-ratelimit-remaining-tokens"] == fresh.headers["x-ratelimit-remaining-tokens"]
    finally:
        world.store.delete_policy(None, policy.id)
        world.policies_seen()


# -- audit ----------------------------------------------------------------------------------


def test_every_call_is_audited_on_a_verified_chain(world: World) -> None:
    tenant, key = world.tenant_key()
    world.store.create_policy(tenant.id, "rate_limit", "rpm", {"scope": "tenant", "requests_per_minute": 1})
    world.policies_seen()
    ok = chat(world, key, "my e-mail is someone@example.com")
    world.settled()
    limited = chat(world, key, "again")
    unauthenticated = world.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert (ok.status_code, limited.status_code, unauthenticated.status_code) == (200, 429, 401)

    spool = world.data_dir / "audit"
    lines = [json.loads(line) for segment in sorted((spool / "segments").glob("*.jsonl")) for line in segment.read_text().splitlines()]
    events = {e["event"]["request_id"]: e["event"] for e in lines}
    allowed = events[ok.headers["x-request-id"]]
    assert allowed["decision"] == "allow" and allowed["status"] == 200 and allowed["tenant_id"] == tenant.id
    assert allowed["prompt_tokens"] > 0 and allowed["completion_tokens"] > 0 and allowed["prompt_hmac"]
    assert "someone@example.com" not in json.dumps(lines)  # content only as keyed hashes
    assert events[limited.headers["x-request-id"]]["decision"] == "deny"
    assert events[unauthenticated.headers["x-request-id"]]["status"] == 401
    assert verify_spool(spool).ok


def test_a_call_the_audit_trail_cannot_record_is_answered_503(make_app: Any, tmp_path: Path) -> None:
    store = PolicyStore.open(StoreSettings(), tmp_path)
    tenant = store.create_tenant("acme")
    key = store.create_api_key(tenant.id, "k", "member")[1]
    try:
        with TestClient(make_app(store, data_dir=str(tmp_path))) as client:
            models = client.get("/v1/models", headers=bearer(key))
            assert models.status_code == 200
            client.app.state.audit_trail.close()  # the spool refuses from now on
            refused = client.get("/v1/models", headers=bearer(key))
            assert refused.status_code == 503 and error_of(refused)["code"]
            assert refused.headers["retry-after"] == "1"
    finally:
        store.close()


@pytest.mark.parametrize(
    ("audit", "interval"),
    [({}, 0.1), ({"fsync_interval_seconds": 0.5}, 0.5), ({"fsync_interval_seconds": 0.5, "wait_durable": True}, 0.0)],
)
def test_the_spool_fsync_interval_follows_the_audit_settings(
    tmp_path: Path, audit: dict[str, Any], interval: float
) -> None:
    # Answers that wait for their fsync (wait_durable) must not also wait out an interval.
    store = PolicyStore.open(StoreSettings(), tmp_path)
    try:
        traffic = TrafficPolicy.build(Settings(data_dir=tmp_path, audit=audit), store)
        assert traffic.spool_settings.sync_interval_seconds == interval
    finally:
        store.close()


def test_a_spool_behind_its_chain_in_the_shared_index_does_not_start(tmp_path: Path) -> None:
    """A spool lost and re-created under a fixed audit.chain_id (or a replica given another's) would
    write seqs its chain has used: the gateway refuses to start, saying why, rather than index nothing."""
    store = PolicyStore.open(StoreSettings(), tmp_path)
    try:
        traffic = TrafficPolicy.build(Settings(data_dir=tmp_path, audit={"chain_id": "gw-1"}), store)
        with Spool.open(traffic.spool_settings) as spool:  # its earlier life: three events, indexed
            receipts = [spool.append(make_event()) for _ in range(3)]
            assert all(r.wait(10) for r in receipts)
            traffic.audit_store.index(spool.read(Cursor(1, 0), 10)[0])
        shutil.rmtree(traffic.spool_settings.directory)
        with pytest.raises(ChainConflict, match="'gw-1' at seq 2, but this spool's chain ends at seq -1"):
            asyncio.run(traffic.start())
        # Without a fixed chain id a new spool is a new chain, and starts.
        shutil.rmtree(traffic.spool_settings.directory)
        fresh = TrafficPolicy.build(Settings(data_dir=tmp_path), store)

        async def start_and_close() -> str:
            trail = await fresh.start()
            await fresh.close()
            return trail.spool.chain_id

        assert asyncio.run(start_and_close()) != "gw-1"
    finally:
        store.close()
