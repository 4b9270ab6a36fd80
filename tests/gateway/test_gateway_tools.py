"""Tool calling on ``/v1/chat/completions`` with the official ``openai`` client over a real socket.

A full round trip (question -> ``tool_calls`` -> ``tool`` result -> answer), whole and
streamed, with ``tool_choice`` required and a named function: the call's arguments
validate with ``jsonschema`` (the call is decoded under its schema), ``finish_reason`` is
"tool_calls", ids are ``call_...`` and unique; streamed, the id, type and name come once,
on the first fragment, and the fragments concatenate to the same arguments as the whole
answer at temperature 0. Bad tools are 400s naming the parameter. The policy chain: input
guardrails read the tools' descriptions, output guardrails the arguments (a blocked word in
a string value blocks, an e-mail is redacted inside the value and the arguments stay
JSON), OPA is told the tools' names, and the audit event names the called function but
holds no argument value.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from http_helpers import bearer, error_of
from test_gateway_embeddings import World, start_world

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}  # fmt: skip
TIME = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                      "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# A call is at most about 60 tokens under these schemas; the answer after the result is cut short.
CALL_TOKENS, ANSWER_TOKENS = 80, 24


@pytest.fixture(scope="module")
def client(live_server: str, admin_key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server}/v1", api_key=admin_key, max_retries=0, timeout=600) as c:
        yield c


def _check_call(call: Any, name: str | None = None) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    assert call.function.name in SCHEMAS and (name is None or call.function.name == name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments  # type: ignore[no-any-return]


def _finish(client: openai.OpenAI, asked: Any, **extra: Any) -> Any:
    """The rest of the round trip: the call and its result go back, the model answers in text."""
    [call] = asked.choices[0].message.tool_calls
    history = [*ASK, asked.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    return client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=ANSWER_TOKENS,
                                          temperature=0, **extra)  # fmt: skip


def test_round_trip_with_tool_choice_required(client: openai.OpenAI) -> None:
    asked = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=CALL_TOKENS, temperature=0)  # fmt: skip
    [choice] = asked.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    _check_call(call)
    answer = _finish(client, asked)
    [final] = answer.choices
    assert final.message.tool_calls is None and final.message.content
    assert final.finish_reason in ("stop", "length")


def test_streamed_round_trip_with_a_named_function(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                           max_tokens=CALL_TOKENS, temperature=0)  # fmt: skip
    _check_call(whole.choices[0].message.tool_calls[0], "get_time")
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                                 max_tokens=CALL_TOKENS, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    fragments = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    first, rest = fragments[0], fragments[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_time"
    assert rest and all(f.index == 0 and f.id is None and f.function.name is None for f in rest)
    arguments = "".join(f.function.arguments or "" for f in fragments)
    assert arguments == whole.choices[0].message.tool_calls[0].function.arguments
    assert first.id != whole.choices[0].message.tool_calls[0].id
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The round trip, streamed: the call (as the stream gave it) and its result go back.
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": first.id, "type": "function", "function": {"name": "get_time", "arguments": arguments}}]},
               {"role": "tool", "tool_call_id": first.id, "content": "14:05"}]  # fmt: skip
    answer = list(client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, stream=True,
                                                 max_tokens=ANSWER_TOKENS, temperature=0))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    assert text and not any(c.choices[0].delta.tool_calls for c in answer if c.choices)


def test_parallel_calls_when_asked_for(client: openai.OpenAI) -> None:
    """parallel_tool_calls true: an array of calls, each with its own id, all valid (or cut by max_tokens)."""
    asked = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=True, max_tokens=120, temperature=0)  # fmt: skip
    [choice] = asked.choices
    calls = choice.message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    assert choice.finish_reason in ("tool_calls", "length")
    for call in complete:
        _check_call(call)


def test_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0)  # fmt: skip
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content


# -- 400s ------------------------------------------------------------------------------------------


def _tool(name: str = "f", parameters: Any = None, **function: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": name, **function}
    if parameters is not None:
        spec["parameters"] = parameters
    return {"type": "function", "function": spec}


CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}  # fmt: skip
BAD = [
    ({"tools": [_tool(), _tool("bad name")]}, "tools[1].function.name"),
    ({"tools": [_tool(), _tool("x" * 65)]}, "tools[1].function.name"),
    ({"tools": [_tool(), _tool("g"), _tool("f")]}, "tools[2].function.name"),
    ({"tools": [_tool(parameters={"type": "string"})]}, "tools[0].function.parameters"),
    ({"tools": [_tool(parameters={"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}})]},
     "tools[0].function.parameters"),
    ({"tools": [_tool(parameters={"type": "object", "if": {}})]}, "tools[0].function.parameters"),
    ({"tools": [_tool(parameters=[1])]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [_tool(f"f{i}") for i in range(129)]}, "tools"),
    ({"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"tools": [_tool()], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [_tool()], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [_tool()], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_9", "content": "r"}]},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": CALLED["tool_calls"]}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x"}, {**CALLED, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x"}, {**CALLED, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"functions": [{"name": "f"}]}, "functions"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_tools_are_400s_naming_the_parameter(live_server: str, admin_key: str, extra: dict[str, Any],
                                                 param: str) -> None:  # fmt: skip
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **extra}
    response = httpx.post(f"{live_server}/v1/chat/completions", json=body, headers=bearer(admin_key), timeout=60)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_history_with_calls_and_results_is_accepted(client: openai.OpenAI) -> None:
    history = [{"role": "user", "content": "x"}, CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "r"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, max_tokens=1)  # no tools: answered in text
    assert answer.choices[0].message.tool_calls is None


# -- the policy chain ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    yield from start_world(make_app, tmp_path_factory.mktemp("tools"))


def _send_mail(to: list[str]) -> list[dict[str, Any]]:
    """A tool whose one argument can only be one of ``to``: the model's call is known in advance."""
    parameters = {"type": "object", "properties": {"to": {"enum": to}, "body": {"type": "string", "maxLength": 8}},
                  "required": ["to", "body"]}  # fmt: skip
    return [{"type": "function", "function": {"name": "send_mail", "description": "Send an e-mail",
                                              "parameters": parameters}}]  # fmt: skip


def _call(world: World, key: str, tools: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Mail Bob."}], "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": tools[0]["function"]["name"]}},
            "max_tokens": 40, "temperature": 0, **extra}  # fmt: skip
    return world.client.post("/v1/chat/completions", json=body, headers=bearer(key))


@pytest.mark.parametrize("stream", [False, True])
def test_output_guardrails_read_the_arguments(world: World, stream: bool) -> None:
    tenant, key = world.tenant_key()
    # Output only: the enums that make the model write these words are input, and must reach it.
    world.store.create_policy(tenant.id, "guardrail", "g", {
        "blocklist": [{"id": "no-ski", "literal": "skiing", "direction": "output"}],
        "pii": {"email": {"mode": "redact", "direction": "output"}}})  # fmt: skip
    world.policies_seen()
    redacted = _call(world, key, _send_mail(["bob@example.com"]), stream=stream)
    blocked = _call(world, key, _send_mail(["skiing"]), stream=stream)
    if not stream:
        [choice] = redacted.json()["choices"]
        assert choice["finish_reason"] == "tool_calls", choice
        arguments = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
        assert arguments["to"] == "[EMAIL]"
        [choice] = blocked.json()["choices"]
        assert choice["finish_reason"] == "content_filter" and "tool_calls" not in choice["message"]
        return
    arguments = "".join(d["function"].get("arguments", "") for c in _chunks(redacted)
                        for d in c["choices"][0]["delta"].get("tool_calls", ()))  # fmt: skip
    assert json.loads(arguments)["to"] == "[EMAIL]"
    sent = _chunks(blocked)
    assert [c["choices"][0]["finish_reason"] for c in sent if c["choices"][0]["finish_reason"]] == ["content_filter"]
    assert "skiing" not in blocked.text


def _chunks(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_input_guardrails_read_the_tool_definitions(world: World) -> None:
    tenant, key = world.tenant_key()
    world.store.create_policy(tenant.id, "guardrail", "g", {"blocklist": [{"id": "no-ski", "literal": "skiing"}]})
    world.policies_seen()
    tools = _send_mail(["bob"])
    tools[0]["function"]["description"] = "Book skiing lessons"
    refused = _call(world, key, tools)
    assert refused.status_code == 400 and error_of(refused)["code"] == "content_filter"
    history = {"messages": [{"role": "user", "content": "x"}, CALLED,
                            {"role": "tool", "tool_call_id": "call_1", "content": "went skiing"}]}  # fmt: skip
    refused = _call(world, key, _send_mail(["bob"]), **history)
    assert refused.status_code == 400 and error_of(refused)["code"] == "content_filter"


def test_opa_is_told_the_tool_names(world: World) -> None:
    tenant, key = world.tenant_key()
    rego = ("package inferflux.guardrails\n"
            "default decision := {\"allow\": true}\n"
            "decision := {\"allow\": false, \"reasons\": [\"no mail\"]} if { \"send_mail\" in input.tools }\n")  # fmt: skip
    world.store.create_policy(tenant.id, "guardrail", "opa", {"opa": {"engine": "embedded", "rego": rego}})
    world.policies_seen()
    denied = _call(world, key, _send_mail(["bob"]))
    assert denied.status_code == 403 and "no mail" in error_of(denied)["message"]
    other = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
    assert _call(world, key, other, max_tokens=2).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_audit_names_the_called_function_not_its_arguments(world: World, stream: bool) -> None:
    _, key = world.tenant_key()
    answered = _call(world, key, _send_mail(["zanzibar-quokka"]), stream=stream)
    if stream:
        calls = [d for c in _chunks(answered) for d in c["choices"][0]["delta"].get("tool_calls", ())]
        assert "zanzibar-quokka" in "".join(d["function"]["arguments"] for d in calls)
    else:
        assert "zanzibar-quokka" in answered.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    world.settled()
    event = world.events()[answered.headers["x-request-id"]]
    assert event["detail"] == {"tool_calls": ["send_mail"]} and event["completion_hmac"]
    spool = world.data_dir / "audit" / "segments"
    assert "zanzibar-quokka" not in "".join(s.read_text() for s in Path(spool).glob("*.jsonl"))
