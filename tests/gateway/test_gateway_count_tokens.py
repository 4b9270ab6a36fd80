"""``POST /v1/messages/count_tokens`` over a real socket with Anthropic's official client, on the real model.

The count is the prompt ``/v1/messages`` gives the model for the same body, so the
strongest check is that it equals that call's ``usage.input_tokens``; then the policy
chain as the Messages route has it (allow-list 404, input guardrails, OPA told the
route, the audit event), the limits (a count is a request, and spends no tokens) and
Anthropic's error shapes; and ``inferctl count-tokens``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from inferflux.gateway import cli
from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from app_world import LiveWorld, open_live_world

MODEL = DEFAULT_MODEL_NAME
POLL = 0.05  # the server here re-reads policies this often
PATH = "/v1/messages/count_tokens"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class World(LiveWorld):
    tenant_prefix = "c"

    def client(self, key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_live_world(World, make_app, tmp_path_factory.mktemp("count"),
                         auth={"revocation_poll_seconds": POLL}) as world:  # fmt: skip
        yield world


@pytest.mark.parametrize("extra", [
    {},
    {"system": "You are a terse geography teacher."},
    {"system": [{"type": "text", "text": "Be brief."}], "tools": [WEATHER], "tool_choice": {"type": "auto"}},
])  # fmt: skip
def test_the_count_is_what_messages_reads(world: World, extra: dict[str, Any]) -> None:
    _, key = world.tenant_key()
    with world.client(key) as an:
        counted = an.messages.count_tokens(model=MODEL, messages=ASK, **extra)  # type: ignore[arg-type]
        answered = an.messages.create(model=MODEL, max_tokens=1, messages=ASK, **extra)  # type: ignore[arg-type]
    assert counted.input_tokens == answered.usage.input_tokens > 5


def test_a_longer_conversation_counts_more(world: World) -> None:
    _, key = world.tenant_key()
    turns = [*ASK, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}]
    with world.client(key) as an:
        short = an.messages.count_tokens(model=MODEL, messages=ASK).input_tokens  # type: ignore[arg-type]
        longer = an.messages.count_tokens(model=MODEL, messages=turns).input_tokens  # type: ignore[arg-type]
    assert longer > short


def test_the_allow_list_answers_404(world: World) -> None:
    _, key = world.tenant_key(allowed_models=["some-other-model"])
    with world.client(key) as an, pytest.raises(anthropic.NotFoundError) as missing:
        an.messages.count_tokens(model=MODEL, messages=ASK)  # type: ignore[arg-type]
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_errors_are_anthropics_naming_its_fields(world: World) -> None:
    _, key = world.tenant_key()
    with world.client(key) as an:
        with pytest.raises(anthropic.BadRequestError) as bad:
            an.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [{"type": "image"}]}])  # type: ignore[list-item]
        assert bad.value.body["error"]["param"] == "messages[0].content[0].type"  # type: ignore[index]
        with pytest.raises(anthropic.BadRequestError) as stop:
            an.messages.count_tokens(model=MODEL, messages=ASK, extra_body={"stop_sequences": ["a", 7]})
        assert stop.value.body["error"]["param"].startswith("stop_sequences")  # type: ignore[index]
    with world.client("ifx_not-a-key") as stranger, pytest.raises(anthropic.AuthenticationError):
        stranger.messages.count_tokens(model=MODEL, messages=ASK)  # type: ignore[arg-type]
    bare = httpx.post(f"{world.url}{PATH}", json={"model": MODEL, "messages": []},
                      headers={"authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
    assert bare.status_code == 400 and bare.json()["type"] == "error"


def test_input_guardrails_block_or_redact_a_count(world: World) -> None:
    tenant, key = world.tenant_key()
    world.store.create_policy(tenant.id, "guardrail", "g", {"blocklist": [{"id": "no-ski", "literal": "ski"}],
                                                            "pii": {"email": "redact"}})  # fmt: skip
    _, plain = world.tenant_key()
    time.sleep(3 * POLL)

    def count(key: str, text: str) -> int:
        with world.client(key) as an:
            return an.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": text}]).input_tokens

    with pytest.raises(anthropic.BadRequestError) as blocked:
        count(key, "let's go ski")
    assert blocked.value.body["error"]["code"] == "content_filter"  # type: ignore[index]
    # Redacted, the prompt the model would read is counted.
    assert count(key, "write to bob.longname@example.com") == count(plain, "write to [EMAIL]")
    assert count(plain, "write to bob.longname@example.com") != count(plain, "write to [EMAIL]")


def test_opa_is_told_the_route(world: World) -> None:
    tenant, key = world.tenant_key()
    rego = "\n".join(["package inferflux.guardrails",
                      'default decision := {"allow": true}',
                      'decision := {"allow": false, "reasons": ["no counting"]} if {',
                      '  input.route == "/v1/messages/count_tokens"',
                      "  input.tokens.prompt > 0",  # told the prompt's tokens, and no completion
                      "  input.tokens.max_completion == 0",
                      "}", ""])  # fmt: skip
    world.store.create_policy(tenant.id, "guardrail", "opa", {"opa": {"engine": "embedded", "rego": rego}})
    time.sleep(3 * POLL)
    with world.client(key) as an:
        assert an.messages.create(model=MODEL, max_tokens=1, messages=ASK).usage.output_tokens == 1  # type: ignore[arg-type]
        with pytest.raises(anthropic.PermissionDeniedError) as denied:
            an.messages.count_tokens(model=MODEL, messages=ASK)  # type: ignore[arg-type]
    assert "no counting" in denied.value.body["error"]["message"]  # type: ignore[index]


def test_a_count_spends_no_tokens(world: World) -> None:
    tenant, key = world.tenant_key()
    # A token quota smaller than the prompt: every generation is refused, no count is.
    world.store.create_policy(tenant.id, "quota", "tiny", {"scope": "tenant", "period": "day", "tokens": 3})
    time.sleep(3 * POLL)
    with world.client(key) as an:
        counts = {an.messages.count_tokens(model=MODEL, messages=ASK).input_tokens for _ in range(3)}  # type: ignore[arg-type]
        assert len(counts) == 1 and counts.pop() > 3
        with pytest.raises(anthropic.RateLimitError):
            an.messages.create(model=MODEL, max_tokens=1, messages=ASK)  # type: ignore[arg-type]


def test_a_count_is_a_request_to_the_rate_limits(world: World) -> None:
    tenant, key = world.tenant_key()
    world.store.create_policy(tenant.id, "rate_limit", "rpm", {"requests_per_minute": 2})
    time.sleep(3 * POLL)
    with world.client(key) as an:
        for _ in range(2):
            assert an.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0  # type: ignore[arg-type]
        with pytest.raises(anthropic.RateLimitError) as limited:
            an.messages.count_tokens(model=MODEL, messages=ASK)  # type: ignore[arg-type]
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


def test_one_audit_event_naming_the_route_with_no_tokens(world: World) -> None:
    tenant, key = world.tenant_key()
    ok = httpx.post(f"{world.url}{PATH}", json={"model": MODEL, "messages": ASK},
                    headers={"authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
    refused = httpx.post(f"{world.url}{PATH}", json={"model": MODEL},
                         headers={"authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
    assert (ok.status_code, refused.status_code) == (200, 400) and ok.json()["input_tokens"] > 0
    events = world.events()
    event = events[ok.headers["x-request-id"]]
    assert (event["route"], event["status"], event["model"], event["tenant_id"]) == (f"POST {PATH}", 200, MODEL,
                                                                                     tenant.id)  # fmt: skip
    assert (event["prompt_tokens"], event["completion_tokens"]) == (0, 0) and event["prompt_hmac"]
    assert events[refused.headers["x-request-id"]]["route"] == f"POST {PATH}"


def test_inferctl_count_tokens(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    _, key = world.tenant_key()
    client = ["--url", world.url, "--api-key", key]
    with world.client(key) as an:
        expected = an.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK).input_tokens  # type: ignore[arg-type]
    assert cli.main(["count-tokens", ASK[0]["content"], "--system", "Be brief.", "--model", MODEL, *client]) == 0
    assert capsys.readouterr().out.strip() == str(expected)
    assert cli.main(["count-tokens", "Hi", "--json", *client]) == 0  # the first model the server lists
    assert json.loads(capsys.readouterr().out)["input_tokens"] > 0
    assert cli.main(["count-tokens", "Hi", "--model", "no-such-model", *client]) == 1
    assert "HTTP 404" in capsys.readouterr().err
