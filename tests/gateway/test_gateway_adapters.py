"""``POST /v1/responses`` and ``POST /v1/messages`` over a real socket, with the official ``openai`` and ``anthropic``
clients, on the real model.

Both are adapters over the chat path, so the strongest check is that they say
what the chat route says for the same conversation (greedy): the same text, the
same token counts. Then each vendor's shapes (objects, typed stream events),
its errors (each client raises its own exception class, with the right status
and the vendor's field named) and the policy chain as the chat route has it:
a tenant's allow-list (404), input guardrails (400 content_filter), a token
quota charged like chat's, OPA told the route, one audit event naming the route.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from inferflux.policy.store import PolicyStore, StoreSettings
from app_world import LiveWorld, open_live_world
from servers import start_uvicorn, stop_uvicorn

MODEL = DEFAULT_MODEL_NAME
POLL = 0.05  # the server here re-reads policies this often
QUESTION = "What is the capital of France?"
SYSTEM = "You are a terse geography teacher."
# The anthropic client (2.x) has no sampling parameters of its own any more; the API still takes them.
GREEDY = {"temperature": 0}


class World(LiveWorld):
    """A live server with its own store: tenants, keys and policies per test, both vendors' clients."""

    tenant_prefix = "a"

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def anthropic(self, key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, timeout=120)

    def post(self, path: str, key: str | None, body: dict[str, Any], **headers: str) -> httpx.Response:
        auth = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.url}{path}", json=body, headers={**auth, **headers}, timeout=120)


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_live_world(World, make_app, tmp_path_factory.mktemp("adapters"),
                         auth={"revocation_poll_seconds": POLL}) as world:  # fmt: skip
        yield world


@pytest.fixture(scope="module")
def key(world: World) -> str:
    return world.tenant_key()[1]


@pytest.fixture(scope="module")
def oa(world: World, key: str) -> Iterator[openai.OpenAI]:
    with world.openai(key) as client:
        yield client


@pytest.fixture(scope="module")
def an(world: World, key: str) -> Iterator[anthropic.Anthropic]:
    with world.anthropic(key) as client:
        yield client


def chat(oa: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return oa.chat.completions.create(model=MODEL, messages=messages, temperature=0, **extra)  # type: ignore[arg-type]


# -- /v1/responses ---------------------------------------------------------------------------


def test_a_response_says_what_chat_says(oa: openai.OpenAI) -> None:
    resp = oa.responses.create(model=MODEL, input=QUESTION, instructions=SYSTEM, max_output_tokens=12, temperature=0)
    same = chat(oa, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], max_tokens=12)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert resp.output_text == same.choices[0].message.content and resp.output_text
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert resp.usage is not None and same.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (same.usage.prompt_tokens,
                                                                   same.usage.completion_tokens)  # fmt: skip
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.instructions == SYSTEM and resp.store is False
    finished = same.choices[0].finish_reason
    assert (resp.status, resp.incomplete_details) == (("completed", None) if finished == "stop" else
                                                      ("incomplete", resp.incomplete_details))  # fmt: skip


def test_items_are_a_multi_turn_conversation(oa: openai.OpenAI) -> None:
    items = [
        {"role": "developer", "content": SYSTEM},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a big city."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "In which "}, {"type": "input_text",
                                                                                 "text": "country is it?"}]},
    ]  # fmt: skip
    resp = oa.responses.create(model=MODEL, input=items, max_output_tokens=10, temperature=0)  # type: ignore[arg-type]
    same = chat(oa, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a big city."},
                     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "In which country is it?"}],
                max_tokens=10)  # fmt: skip
    assert resp.output_text == same.choices[0].message.content


def test_max_output_tokens_makes_an_incomplete_response(oa: openai.OpenAI) -> None:
    resp = oa.responses.create(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 3


def test_a_streamed_response_sends_the_typed_events(oa: openai.OpenAI) -> None:
    whole = oa.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
    events = list(oa.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]  # fmt: skip
    end = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.status == whole.status
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id == events[0].response.id  # type: ignore[union-attr]
    assert events[0].response.status == "in_progress"  # type: ignore[union-attr]


PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                        "species": {"enum": ["cat", "dog", "bird"]}},
       "required": ["name", "species"], "additionalProperties": False}  # fmt: skip


def test_text_format_json_schema_parses_and_validates(oa: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}
    resp = oa.responses.create(model=MODEL, input="Describe a pet.", max_output_tokens=64, temperature=1.0,
                               text={"format": fmt})  # type: ignore[arg-type]
    jsonschema.validate(json.loads(resp.output_text), PET)
    assert resp.text is not None and resp.text.format is not None and resp.text.format.type == "json_schema"
    obj = oa.responses.create(model=MODEL, input="Describe a pet in JSON.", max_output_tokens=32,
                              text={"format": {"type": "json_object"}})  # fmt: skip
    assert isinstance(json.loads(obj.output_text), dict)


def test_responses_parse_with_a_pydantic_model(oa: openai.OpenAI) -> None:
    from pydantic import BaseModel, Field

    # Bounded strings (maxLength reaches the grammar), so the object closes within the token budget
    # whatever the small model writes: unbounded, its greedy answer ran on past 64 tokens with float32 weights.
    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    parsed = oa.responses.parse(model=MODEL, input="Describe Paris.", max_output_tokens=64, text_format=City)
    assert isinstance(parsed.output_parsed, City)


def test_store_is_answered_as_not_stored_and_stateful_fields_are_refused(oa: openai.OpenAI) -> None:
    assert oa.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=True).store is False
    refused = [({"previous_response_id": "resp_123"}, "previous_response_id"),
               ({"conversation": "conv_1"}, "conversation"), ({"background": True}, "background"),
               ({"include": ["message.output_text.logprobs"]}, "include"),
               ({"truncation": "auto"}, "truncation"),
               ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
               ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
                "input[0].content[0].type")]  # fmt: skip
    for extra, param in refused:
        body: dict[str, Any] = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **extra}
        with pytest.raises(openai.BadRequestError) as caught:
            oa.responses.create(**body)
        assert caught.value.status_code == 400
        error = caught.value.body  # the client hands over the body's "error" object
        assert isinstance(error, dict) and error["param"] == param and error["code"] == "unsupported_parameter", error


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [3]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"not": {}}}}}, "text.format"),
])  # fmt: skip
def test_bad_responses_bodies_are_400s_naming_the_field(world: World, key: str, body: dict[str, Any],
                                                        param: str) -> None:  # fmt: skip
    response = world.post("/v1/responses", key, {"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error"} and response.json()["error"]["param"] == param, response.text


def test_responses_errors_are_the_openai_clients_exceptions(world: World, oa: openai.OpenAI) -> None:
    with world.openai("ifx_not_a_key") as bad, pytest.raises(openai.AuthenticationError):
        bad.responses.create(model=MODEL, input="Hi")
    with pytest.raises(openai.NotFoundError) as caught:
        oa.responses.create(model="no-such-model", input="Hi")
    assert caught.value.status_code == 404


# -- /v1/messages --------------------------------------------------------------------------------


def test_a_message_says_what_chat_says(an: anthropic.Anthropic, oa: openai.OpenAI) -> None:
    turns = [{"role": "user", "content": "Name a big city."}, {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": [{"type": "text", "text": "In which "}, {"type": "text", "text": "country?"}]}]
    msg = an.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=turns, extra_body=GREEDY)  # type: ignore[arg-type]
    same = chat(oa, [{"role": "system", "content": SYSTEM}, *turns[:2], {"role": "user", "content": "In which country?"}],
                max_tokens=12)  # fmt: skip
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_") and msg.model == MODEL
    [block] = msg.content
    assert block.type == "text" and block.text == same.choices[0].message.content
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[same.choices[0].finish_reason]
    assert same.usage is not None
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (same.usage.prompt_tokens, same.usage.completion_tokens)


def test_system_as_blocks_and_max_tokens_stop(an: anthropic.Anthropic) -> None:
    msg = an.messages.create(model=MODEL, max_tokens=3, system=[{"type": "text", "text": SYSTEM}],
                             messages=[{"role": "user", "content": "Write a long story about a dragon."}])  # fmt: skip
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_stop_sequences_cut_the_text(an: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": QUESTION}]
    free = an.messages.create(model=MODEL, max_tokens=16, messages=ask, extra_body=GREEDY)  # type: ignore[arg-type]
    text = free.content[0].text  # type: ignore[union-attr]
    word = next(w for w in text.split()[1:] if len(w) > 2)
    stops = ["never in this text", word]
    cut = an.messages.create(model=MODEL, max_tokens=16, messages=ask, extra_body=GREEDY, stop_sequences=stops)  # type: ignore[arg-type]
    assert cut.content[0].text == text[: text.index(word)]  # type: ignore[union-attr]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", word)
    events = list(an.messages.create(model=MODEL, max_tokens=16, messages=ask, extra_body=GREEDY,  # type: ignore[arg-type]
                                     stop_sequences=stops, stream=True))  # fmt: skip
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", word)  # type: ignore[union-attr]
    assert free.stop_sequence is None


def test_output_config_format_is_json_valid_against_the_schema(an: anthropic.Anthropic) -> None:
    msg = an.messages.create(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "Describe a pet."}],
                             output_config={"format": {"type": "json_schema", "schema": PET}})  # fmt: skip
    jsonschema.validate(json.loads(msg.content[0].text), PET)  # type: ignore[union-attr]
    with pytest.raises(anthropic.BadRequestError) as caught:
        an.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}],
                           output_config={"format": {"type": "json_schema", "schema": {"not": {}}}})  # fmt: skip
    assert caught.value.body["error"]["param"] == "output_config.format"  # type: ignore[index]


def test_a_streamed_message_sends_anthropics_events(an: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": QUESTION}]
    whole = an.messages.create(model=MODEL, max_tokens=12, messages=ask, extra_body=GREEDY)  # type: ignore[arg-type]
    events = list(an.messages.create(model=MODEL, max_tokens=12, messages=ask, extra_body=GREEDY, stream=True))  # type: ignore[arg-type]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")  # type: ignore[union-attr]
    assert text == whole.content[0].text  # type: ignore[union-attr]
    assert events[-2].delta.stop_reason == whole.stop_reason  # type: ignore[union-attr]
    assert events[-2].usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens  # type: ignore[union-attr]
    with an.messages.stream(model=MODEL, max_tokens=12, messages=ask, extra_body=GREEDY) as stream:  # type: ignore[arg-type]
        assert "".join(stream.text_stream) == text
        assert stream.get_final_message().content[0].text == text  # type: ignore[union-attr]


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens", None),
    ({"max_tokens": 2, "messages": []}, "messages", None),
    ({"max_tokens": 2, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role", None),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type", "unsupported_parameter"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "messages[1]", "unsupported_parameter"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].tool_use_id", None),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature", None),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]},
     "stop_sequences[0]", None),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bash_20250124",
                                                                                  "name": "bash"}]},
     "tools[0].type", "unsupported_parameter"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled",
                                                                                    "budget_tokens": 1024}},
     "thinking", "unsupported_parameter"),
    ({"max_tokens": 10**9, "messages": [{"role": "user", "content": "x"}]}, "max_tokens", None),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "stop_sequences": ["ok", "x" * 600]},
     "stop_sequences[1]", None),
])  # fmt: skip
def test_bad_messages_bodies_are_anthropic_400s_naming_the_field(world: World, key: str, body: dict[str, Any],
                                                                 param: str, code: str | None) -> None:  # fmt: skip
    response = world.post("/v1/messages", None, {"model": MODEL, **body}, **{"x-api-key": key})
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error", payload
    assert payload["error"]["param"] == param and payload["error"]["message"], payload
    assert "stop[" not in payload["error"]["message"], payload  # the chat path's names do not show through
    if code is not None:
        assert payload["error"]["code"] == code, payload


def test_messages_errors_are_the_anthropic_clients_exceptions(world: World, an: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "Hi"}]
    with world.anthropic("ifx_not_a_key") as bad, pytest.raises(anthropic.AuthenticationError) as unauthenticated:
        bad.messages.create(model=MODEL, max_tokens=2, messages=ask)  # type: ignore[arg-type]
    assert unauthenticated.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        an.messages.create(model="no-such-model", max_tokens=2, messages=ask)  # type: ignore[arg-type]
    assert missing.value.body == {"type": "error", "error": {"type": "not_found_error", "param": "model",
                                                             "code": "model_not_found",
                                                             "message": "The model 'no-such-model' does not exist"}}
    with pytest.raises(anthropic.BadRequestError):
        an.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [  # type: ignore[arg-type]
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    no_key = httpx.post(f"{world.url}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": ask})
    assert no_key.status_code == 401 and no_key.json()["type"] == "error"
    assert no_key.json()["error"]["code"] == "missing_credentials"


# -- the policy chain, as the chat route has it ----------------------------------------------------


def test_the_allow_list_answers_404_on_both(world: World) -> None:
    _, key = world.tenant_key(allowed_models=["some-other-model"])
    with world.openai(key) as oa, pytest.raises(openai.NotFoundError):
        oa.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with world.anthropic(key) as an, pytest.raises(anthropic.NotFoundError):
        an.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])


def test_input_guardrails_block_on_both(world: World) -> None:
    tenant, key = world.tenant_key()
    world.store.create_policy(tenant.id, "guardrail", "g", {"blocklist": [{"id": "no-ski", "literal": "ski"}]})
    time.sleep(3 * POLL)
    with world.openai(key) as oa, pytest.raises(openai.BadRequestError) as blocked:
        oa.responses.create(model=MODEL, input=[{"role": "user", "content": "fine"}], instructions="let's go ＳＫＩ")
    assert blocked.value.code == "content_filter"
    with world.anthropic(key) as an, pytest.raises(anthropic.BadRequestError) as refused:
        an.messages.create(model=MODEL, max_tokens=2, system="fine", messages=[
            {"role": "user", "content": [{"type": "text", "text": "let's go ski"}]}])  # fmt: skip
    assert refused.value.body["error"]["code"] == "content_filter"  # type: ignore[index]


def test_a_token_quota_is_charged_as_chat_charges_it(world: World) -> None:
    tenant, key = world.tenant_key()
    ask = [{"role": "user", "content": QUESTION}]
    with world.anthropic(key) as an, world.openai(key) as oa:
        first = an.messages.create(model=MODEL, max_tokens=4, messages=ask, extra_body=GREEDY)  # type: ignore[arg-type]
        spent = first.usage.input_tokens + first.usage.output_tokens
        world.settled()
        # Room for one more of each at their real count (the same conversation: the same tokens); what was
        # spent before the quota existed is not counted.
        world.store.create_policy(tenant.id, "quota", "daily", {"scope": "tenant", "period": "day", "tokens": 2 * spent})
        time.sleep(3 * POLL)
        assert oa.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0).usage.total_tokens \
            == spent  # type: ignore[union-attr]  # fmt: skip
        world.settled()
        assert an.messages.create(model=MODEL, max_tokens=4, messages=ask, extra_body=GREEDY).usage.output_tokens  # type: ignore[arg-type]
        world.settled()
        with pytest.raises(anthropic.RateLimitError) as limited:
            an.messages.create(model=MODEL, max_tokens=4, messages=ask)  # type: ignore[arg-type]
        assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
        with pytest.raises(openai.RateLimitError):
            oa.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4)


def test_opa_is_told_each_route(world: World) -> None:
    tenant, key = world.tenant_key()
    rego = ("package inferflux.guardrails\n"
            "default decision := {\"allow\": true}\n"
            "decision := {\"allow\": false, \"reasons\": [\"no messages here\"]} if { input.route == \"/v1/messages\" }\n")
    world.store.create_policy(tenant.id, "guardrail", "opa", {"opa": {"engine": "embedded", "rego": rego}})
    time.sleep(3 * POLL)
    with world.openai(key) as oa, world.anthropic(key) as an:
        assert oa.responses.create(model=MODEL, input="Hi", max_output_tokens=2).status in ("completed", "incomplete")
        with pytest.raises(anthropic.PermissionDeniedError) as denied:
            an.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert "no messages here" in denied.value.body["error"]["message"]  # type: ignore[index]


@pytest.mark.parametrize(("path", "body", "last_event"), [
    ("/v1/messages", {"max_tokens": 6, "messages": [{"role": "user", "content": QUESTION}]}, "error"),
    ("/v1/responses", {"max_output_tokens": 6, "input": QUESTION}, "response.failed"),
])  # fmt: skip
def test_a_stream_the_audit_refuses_at_its_end_ends_in_its_own_apis_error(
    world: World, key: str, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any], last_event: str
) -> None:
    """The audit layer holds a stream's last event until the call is on record; when the trail refuses it
    (a full spool, say) the stream ends in that API's error framing, never in OpenAI's ``[DONE]``."""
    from inferflux.policy.audit.errors import AuditUnavailable

    async def refuse(*_: Any, **__: Any) -> None:
        raise AuditUnavailable("the audit spool is full")

    monkeypatch.setattr(world.app.state.audit_trail, "record", refuse)  # a fault on the live trail, this call only
    headers = {"authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{world.url}{path}", json={**body, "model": MODEL, "stream": True, **GREEDY},
                      headers=headers, timeout=120) as response:  # fmt: skip
        assert response.status_code == 200
        lines = list(response.iter_lines())
    monkeypatch.undo()
    events = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events[-1] == last_event, events
    assert "[DONE]" not in data
    error = next(json.loads(d) for d, e in zip(data, events) if e == "error")
    assert "audit_unavailable" in json.dumps(error), error


def test_one_audit_event_each_naming_the_route(world: World) -> None:
    tenant, key = world.tenant_key()
    ok = world.post("/v1/responses", key, {"model": MODEL, "input": "my e-mail is someone@example.com",
                                           "max_output_tokens": 3})  # fmt: skip
    streamed = world.post("/v1/messages", key, {"model": MODEL, "max_tokens": 3, "stream": True,
                                                "metadata": {"user_id": "end-user-7"},
                                                "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    refused = world.post("/v1/messages", key, {"model": MODEL, "messages": []})
    assert (ok.status_code, streamed.status_code, refused.status_code) == (200, 200, 400)
    assert streamed.text.rstrip().endswith('data: {"type":"message_stop"}')
    world.settled()
    events = world.events()
    first, second = events[ok.headers["x-request-id"]], events[streamed.headers["x-request-id"]]
    assert (first["route"], first["status"], first["model"], first["tenant_id"]) == ("POST /v1/responses", 200,
                                                                                     MODEL, tenant.id)  # fmt: skip
    assert first["prompt_tokens"] == ok.json()["usage"]["input_tokens"] and first["prompt_hmac"]
    assert (second["route"], second["status"], second["completion_tokens"]) == ("POST /v1/messages", 200, 3)
    assert second["user"] == "end-user-7"  # metadata.user_id is the request's end user
    assert events[refused.headers["x-request-id"]]["route"] == "POST /v1/messages"
    spool = world.data_dir / "audit" / "segments"
    assert "someone@example.com" not in "".join(s.read_text() for s in spool.glob("*.jsonl"))


# -- tools, through the chat path's tool calling --------------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
ASK_WEATHER = "What is the weather in Paris?"


def test_a_responses_tool_round_trip(oa: openai.OpenAI) -> None:
    tools = [{"type": "function", "name": "weather", "description": "The weather in a city now",
              "parameters": WEATHER, "strict": True}]  # fmt: skip
    first = oa.responses.create(model=MODEL, input=ASK_WEATHER, tools=tools, tool_choice="required",  # type: ignore[arg-type]
                                max_output_tokens=64, temperature=0)  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        assert call.call_id and call.status == "completed"
    # The calls go back as items, each with its output; the answer is text.
    history: list[Any] = [{"role": "user", "content": ASK_WEATHER}, *[c.model_dump(exclude_none=True) for c in calls],
                          *[{"type": "function_call_output", "call_id": c.call_id, "output": "18 degrees, sunny"}
                            for c in calls]]  # fmt: skip
    final = oa.responses.create(model=MODEL, input=history, tools=tools, tool_choice="none",  # type: ignore[arg-type]
                                max_output_tokens=24, temperature=0)  # fmt: skip
    assert final.output_text and all(item.type == "message" for item in final.output)
    # Named and streamed: the same call as whole, in argument fragments.
    named = {"type": "function", "name": "weather"}
    whole = oa.responses.create(model=MODEL, input=ASK_WEATHER, tools=tools, tool_choice=named,  # type: ignore[arg-type]
                                max_output_tokens=64, temperature=0)  # fmt: skip
    events = list(oa.responses.create(model=MODEL, input=ASK_WEATHER, tools=tools, tool_choice=named,  # type: ignore[arg-type]
                                      max_output_tokens=64, temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    streamed = [i for i in events[-1].response.output if i.type == "function_call"]  # type: ignore[union-attr]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in whole.output
                                                         if c.type == "function_call"]  # fmt: skip
    fragments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    assert fragments == "".join(c.arguments for c in streamed)


def test_an_anthropic_tool_round_trip(an: anthropic.Anthropic) -> None:
    tools = [{"name": "weather", "description": "The weather in a city now", "input_schema": WEATHER}]
    ask: list[Any] = [{"role": "user", "content": ASK_WEATHER}]
    first = an.messages.create(model=MODEL, max_tokens=64, messages=ask, tools=tools, tool_choice={"type": "any"},  # type: ignore[arg-type]
                               extra_body=GREEDY)  # fmt: skip
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and all(u.name == "weather" for u in uses)
    for use in uses:
        jsonschema.validate(use.input, WEATHER)
    # The calls go back as the assistant's content, the results as tool_result blocks; the answer is text.
    history = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "18 degrees, sunny"}
                                            for u in uses]}]  # fmt: skip
    final = an.messages.create(model=MODEL, max_tokens=24, messages=history, tools=tools, tool_choice={"type": "none"},  # type: ignore[arg-type]
                               extra_body=GREEDY)  # fmt: skip
    assert final.stop_reason in ("end_turn", "max_tokens") and final.content[0].type == "text"
    assert final.content[0].text  # type: ignore[union-attr]
    # Named and streamed: the SDK puts the input_json_delta fragments back together into the same input.
    named = {"type": "tool", "name": "weather"}
    whole = an.messages.create(model=MODEL, max_tokens=64, messages=ask, tools=tools, tool_choice=named,  # type: ignore[arg-type]
                               extra_body=GREEDY)  # fmt: skip
    with an.messages.stream(model=MODEL, max_tokens=64, messages=ask, tools=tools, tool_choice=named,  # type: ignore[arg-type]
                            extra_body=GREEDY) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert "content_block_start" in kinds and streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
        [(b.name, b.input) for b in whole.content if b.type == "tool_use"]  # fmt: skip


# -- a model an upstream serves ---------------------------------------------------------------------


def test_both_apis_front_a_model_an_upstream_serves(world: World, key: str, oa: openai.OpenAI, an: anthropic.Anthropic,
                                                    app_for_model: Any, tmp_path: Path) -> None:  # fmt: skip
    """A gateway in front of this module's live server (backend openai): the adapters plan through
    plan_remote like chat does, and say what the upstream said; a stop on a stop sequence reads end_turn there
    (an upstream does not report which stop string matched)."""
    from inferflux.backends.base import ModelSpec
    from inferflux.gateway.models.served import load_served_model
    from upstream_rules import LOOPBACK

    spec = ModelSpec(name="fleet", path="", upstream={"endpoints": [f"{world.url}/v1"], "model": MODEL})
    model = load_served_model(spec, "openai", upstream_key=key, egress=LOOPBACK)
    store = PolicyStore.open(StoreSettings(), tmp_path)
    front_key = str(store.ensure_bootstrap_admin())
    server, thread, sock, url = start_uvicorn(app_for_model(model, store, data_dir=str(tmp_path / "app")))
    ask = [{"role": "user", "content": QUESTION}]
    try:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=front_key, max_retries=0, timeout=120) as front_oa, \
                anthropic.Anthropic(base_url=url, api_key=front_key, max_retries=0, timeout=120) as front_an:  # fmt: skip
            remote = front_oa.responses.create(model="fleet", input=QUESTION, max_output_tokens=8, temperature=0)
            local = oa.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0)
            assert remote.output_text == local.output_text and remote.model == "fleet"
            assert remote.usage is not None and local.usage is not None
            assert remote.usage.output_tokens == local.usage.output_tokens  # the upstream's count
            streamed = list(front_an.messages.create(model="fleet", max_tokens=8, messages=ask, extra_body=GREEDY,  # type: ignore[arg-type]
                                                     stream=True))  # fmt: skip
            whole = an.messages.create(model=MODEL, max_tokens=8, messages=ask, extra_body=GREEDY)  # type: ignore[arg-type]
            text = "".join(e.delta.text for e in streamed if e.type == "content_block_delta")  # type: ignore[union-attr]
            assert text == whole.content[0].text and streamed[-1].type == "message_stop"  # type: ignore[union-attr]
            with pytest.raises(anthropic.BadRequestError) as uncounted:  # no tokenizer here for the upstream's model
                front_an.messages.count_tokens(model="fleet", messages=ask)  # type: ignore[arg-type]
            assert uncounted.value.body["error"]["code"] == "model_not_supported"  # type: ignore[index]
    finally:
        model.shutdown()  # while the server's loop runs: the fleet's connections close in it
        stop_uvicorn(server, thread, sock)
        store.close()
