"""The two adapters' translations on their own, without a model: vendor body -> chat body, chat answer and chat
stream chunks (OpenAI's public chat format, tool calls included) -> the vendor's objects and events.

Every object and event the adapters make is validated with the vendor SDK's own pydantic types (``openai``'s
``Response`` and ``ResponseStreamEvent``, ``anthropic``'s ``Message`` and ``RawMessageStreamEvent``), and a
stream's events are accumulated the way the SDKs accumulate them, so a shape the clients cannot read fails
here. The live round trips are in test_gateway_adapters.py.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic.types as at
import openai.types.responses as rt
import pytest
from pydantic import TypeAdapter

from inferflux.gateway.errors import GatewayError, InvalidRequest, UnsupportedParameter
from inferflux.gateway.pipeline.adapters import parse_messages, parse_responses
from inferflux.gateway.pipeline.adapters.common import ChatReader
from inferflux.gateway.pipeline.adapters.errors import rewrite
from inferflux.gateway.pipeline.generation import Usage

MODEL = "m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
HEADER = {"id": "abc123", "created": 1700000000, "model": MODEL, "prompt_tokens": 7}


def usage(prompt: int = 7, completion: int = 5) -> Usage:
    return Usage({0: prompt}, {0: completion})


def chat_answer(content: str | None, calls: list[tuple[str, str, str]] = (), finish: str = "stop") -> dict[str, Any]:  # type: ignore[assignment]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, n, a in calls]  # fmt: skip
    return {"id": "chatcmpl-abc123", "object": "chat.completion", "choices": [
        {"index": 0, "message": message, "finish_reason": finish}]}  # fmt: skip


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


# The chat path's stream for: some text, then two tool calls in fragments (OpenAI's shape: id, type and
# name on a call's first fragment only), then finish_reason tool_calls.
TOOL_STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Let me "}),
    chunk({"content": "check."}),
    chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                           "function": {"name": "weather", "arguments": ""}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                           "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]}),
    chunk({}, finish="tool_calls"),
]  # fmt: skip


def events_of(raw: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event, checking that the name repeats the data's type."""
    out = []
    for blob in raw:
        for text in blob.decode().split("\n\n"):
            if not text:
                continue
            name_line, data_line = text.split("\n")
            name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
            assert data["type"] == name
            out.append((name, data))
    return out


def run_stream(adapter: Any, chunks: list[dict[str, Any]], used: Usage) -> list[tuple[str, dict[str, Any]]]:
    out, reader = adapter.streamer(HEADER), ChatReader()
    raw = list(out.opening())
    for c in chunks:
        for kind, value in reader.read(c):
            raw += out.translate(kind, value)
    return events_of(raw + out.closing(used))


# -- /v1/responses ---------------------------------------------------------------------------------


def responses(**body: Any) -> Any:
    return parse_responses({"model": MODEL, **body})


def test_responses_items_become_chat_messages() -> None:
    adapter = responses(instructions="Be brief.", input=[
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "9C"}]},
    ], tools=[{"type": "function", "name": "weather", "description": "Weather now", "parameters": WEATHER,
               "strict": True}],
        tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False, max_output_tokens=50,
        text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}}, user="u1")  # fmt: skip
    body = adapter.chat_body()
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "9C"},
    ]  # fmt: skip
    assert body["tools"] == [{"type": "function", "function": {"name": "weather", "description": "Weather now",
                                                               "parameters": WEATHER, "strict": True}}]  # fmt: skip
    assert body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert (body["parallel_tool_calls"], body["max_completion_tokens"], body["user"]) == (False, 50, "u1")
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}  # fmt: skip


def test_a_function_call_without_a_turn_before_it_is_its_own_assistant_message() -> None:
    body = responses(input=[{"role": "user", "content": "x"},
                            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]).chat_body()
    assert body["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}  # fmt: skip


def test_a_response_with_tool_calls_has_function_call_items() -> None:
    adapter = responses(input="x", tools=[{"type": "function", "name": "weather", "parameters": WEATHER}])
    answer = ChatReader.of_message(chat_answer(None, [("call_1", "weather", '{"city":"Paris"}')], "tool_calls"))
    obj = adapter.whole(answer, usage(), HEADER)
    resp = rt.Response.model_validate(obj)
    [call] = resp.output
    assert call.type == "function_call" and (call.call_id, call.name, call.arguments) == ("call_1", "weather",
                                                                                          '{"city":"Paris"}')  # fmt: skip
    assert resp.status == "completed" and resp.usage is not None and resp.usage.total_tokens == 12


@pytest.mark.parametrize(("finish", "status", "reason"), [("stop", "completed", None),
                                                          ("length", "incomplete", "max_output_tokens"),
                                                          ("content_filter", "incomplete", "content_filter")])  # fmt: skip
def test_response_status_follows_the_finish_reason(finish: str, status: str, reason: str | None) -> None:
    obj = responses(input="x").whole(ChatReader.of_message(chat_answer("hi", finish=finish)), usage(), HEADER)
    resp = rt.Response.model_validate(obj)
    assert resp.status == status and resp.output_text == "hi"
    assert (resp.incomplete_details.reason if resp.incomplete_details else None) == reason


def test_a_streamed_response_with_tool_calls() -> None:
    adapter = responses(input="x", tools=[{"type": "function", "name": "weather", "parameters": WEATHER}])
    events = run_stream(adapter, TOOL_STREAM, usage())
    parsed = [TypeAdapter(rt.ResponseStreamEvent).validate_python(data) for _, data in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [name for name, _ in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = parsed[-1].response  # type: ignore[union-attr]
    assert [item.type for item in final.output] == ["message", "function_call", "function_call"]
    assert final.output_text == "Let me check."
    assert [(i.call_id, json.loads(i.arguments)) for i in final.output[1:]] == [("call_1", {"city": "Paris"}),
                                                                               ("call_2", {"city": "Oslo"})]  # fmt: skip
    # Each item's events name it by the id and output index it was added with.
    added = {e.item.id: e.output_index for e in parsed if e.type == "response.output_item.added"}  # type: ignore[union-attr]
    for e in parsed:
        if e.type == "response.function_call_arguments.delta":
            assert added[e.item_id] == e.output_index
    assert [i.id for i in final.output] == list(added)


def test_an_empty_stream_is_one_empty_message() -> None:
    events = run_stream(responses(input="x"), [chunk({"role": "assistant", "content": ""}), chunk({}, "stop")],
                        usage(7, 1))  # fmt: skip
    final = rt.Response.model_validate(events[-1][1]["response"])
    assert final.output_text == "" and len(final.output) == 1 and final.status == "completed"


def test_a_failed_stream_ends_with_error_and_response_failed() -> None:
    adapter = responses(input="x", stream=True)
    out = adapter.streamer(HEADER)
    out.opening()
    events = events_of([out.failed(GatewayError("engine failed"))])
    assert [name for name, _ in events] == ["error", "response.failed"]
    for _, data in events:
        TypeAdapter(rt.ResponseStreamEvent).validate_python(data)
    assert events[1][1]["response"]["status"] == "failed"


@pytest.mark.parametrize(("body", "error", "param"), [
    ({"input": "x", "previous_response_id": "r"}, UnsupportedParameter, "previous_response_id"),
    ({"input": "x", "reasoning": {"effort": "high"}}, UnsupportedParameter, "reasoning"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, UnsupportedParameter, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, InvalidRequest, "tools[0].name"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, UnsupportedParameter, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "function"}}, InvalidRequest, "tool_choice.name"),
    ({"input": [{"type": "reasoning", "summary": []}]}, UnsupportedParameter, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]},
     UnsupportedParameter, "input[0].output[0].type"),
    ({"input": [{"role": "user", "content": 5}]}, InvalidRequest, "input[0].content"),
])  # fmt: skip
def test_responses_refusals_name_the_field(body: dict[str, Any], error: type[Exception], param: str) -> None:
    with pytest.raises(error) as caught:
        responses(**body)
    assert type(caught.value) is error and caught.value.param == param  # type: ignore[attr-defined]


def test_chat_parameters_are_renamed_as_the_responses_api_spells_them() -> None:
    adapter = responses(input="x")
    assert [adapter.param(p) for p in ("max_completion_tokens", "response_format.json_schema.schema",
                                       "messages[3].content", "tools[1].function.parameters", "temperature", None)] \
        == ["max_output_tokens", "text.format.schema", "input", "tools[1].parameters", "temperature", None]  # fmt: skip


# -- /v1/messages --------------------------------------------------------------------------------------


def messages(**body: Any) -> Any:
    return parse_messages({"model": MODEL, "max_tokens": 64, **body})


def test_anthropic_blocks_become_chat_messages() -> None:
    adapter = messages(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                      "content": [{"type": "text", "text": "no such city"}]},
                                     {"type": "text", "text": "And now?"}]},
    ], tools=[{"name": "weather", "description": "Weather now", "input_schema": WEATHER}],
        tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"], top_k=5, metadata={"user_id": "u-9"})  # fmt: skip
    body = adapter.chat_body()
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "user", "content": "And now?"},
    ]  # fmt: skip
    assert body["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": WEATHER,
                                                               "description": "Weather now"}}]  # fmt: skip
    assert body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert (body["parallel_tool_calls"], body["stop"], body["top_k"], body["user"], body["max_tokens"]) == (
        False, ["\n\n"], 5, "u-9", 64)
    structured = messages(messages=[{"role": "user", "content": "x"}],
                          output_config={"format": {"type": "json_schema", "schema": WEATHER}}).chat_body()
    assert structured["response_format"] == {"type": "json_schema", "json_schema": {"name": "output",
                                                                                  "schema": WEATHER}}  # fmt: skip


@pytest.mark.parametrize(("choice", "chat"), [("auto", "auto"), ("any", "required"), ("none", "none")])
def test_anthropic_tool_choices(choice: str, chat: str) -> None:
    adapter = messages(messages=[{"role": "user", "content": "x"}], tool_choice={"type": choice},
                       tools=[{"name": "f", "input_schema": {"type": "object"}}])  # fmt: skip
    assert adapter.chat_body()["tool_choice"] == chat and "parallel_tool_calls" not in adapter.chat_body()


def test_a_message_with_tool_calls_has_tool_use_blocks() -> None:
    answer = ChatReader.of_message(chat_answer("Let me check.", [("call_1", "weather", '{"city":"Paris"}')],
                                               "tool_calls"))  # fmt: skip
    msg = at.Message.model_validate(messages(messages=[{"role": "user", "content": "x"}]).whole(answer, usage(),
                                                                                                HEADER))  # fmt: skip
    text, call = msg.content
    assert text.type == "text" and text.text == "Let me check."
    assert call.type == "tool_use" and (call.id, call.name, call.input) == ("call_1", "weather", {"city": "Paris"})
    assert msg.stop_reason == "tool_use" and (msg.usage.input_tokens, msg.usage.output_tokens) == (7, 5)


def test_a_lone_surrogate_the_model_escaped_in_arguments_can_still_be_sent() -> None:
    # '{"city":"\\ud800"}' is valid JSON holding no character; decoded into Anthropic's input object it used to
    # make the answer unencodable (a 500). It reads as U+FFFD instead.
    answer = ChatReader.of_message(chat_answer(None, [("call_1", "weather", '{"city":"\\ud800x"}')], "tool_calls"))
    body = messages(messages=[{"role": "user", "content": "x"}]).whole(answer, usage(), HEADER)
    json.dumps(body, ensure_ascii=False).encode("utf-8")
    [call] = at.Message.model_validate(body).content
    assert call.input == {"city": "\ufffdx"}


@pytest.mark.parametrize(("finish", "string", "stop"), [
    ("stop", None, "end_turn"), ("length", None, "max_tokens"), ("content_filter", None, "refusal"),
    ("tool_calls", None, "tool_use"), ("stop", "\n\n", "stop_sequence")])  # fmt: skip
def test_stop_reasons(finish: str, string: str | None, stop: str) -> None:
    answer = ChatReader.of_message(chat_answer("hi", finish=finish))
    answer.stop_string = string
    message = at.Message.model_validate(messages(messages=[{"role": "user", "content": "x"}]).whole(answer, usage(),
                                                                                                    HEADER))  # fmt: skip
    assert (message.stop_reason, message.stop_sequence) == (stop, string)


def test_a_streamed_message_with_tool_calls_accumulates_as_the_sdk_does() -> None:
    from anthropic.lib.streaming._messages import accumulate_event

    events = run_stream(messages(messages=[{"role": "user", "content": "x"}]), TOOL_STREAM, usage())
    assert [name for name, _ in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    snapshot, buffers = None, {}  # type: ignore[var-annotated]
    for name, data in events:
        if name == "ping":
            continue
        event = TypeAdapter(at.RawMessageStreamEvent).validate_python(data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)  # type: ignore[arg-type]
    assert snapshot is not None
    text, first, second = snapshot.content
    assert text.text == "Let me check."  # type: ignore[union-attr]
    assert (first.id, first.name, first.input) == ("call_1", "weather", {"city": "Paris"})  # type: ignore[union-attr]
    assert second.input == {"city": "Oslo"}  # type: ignore[union-attr]
    assert snapshot.stop_reason == "tool_use" and snapshot.usage.output_tokens == 5


@pytest.mark.parametrize(("body", "error", "param"), [
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                   {"role": "user", "content": "x"}]}, InvalidRequest, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     InvalidRequest, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]}]},
     InvalidRequest, "messages[0].content[0].input"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]}, InvalidRequest,
     "tools[0].input_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}, InvalidRequest,
     "tool_choice.name"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, UnsupportedParameter,
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]}, UnsupportedParameter,
     "system[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "high"}}, UnsupportedParameter,
     "output_config.effort"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"format": {"type": "json_schema"}}},
     InvalidRequest, "output_config.format.schema"),
])  # fmt: skip
def test_messages_refusals_name_the_field(body: dict[str, Any], error: type[Exception], param: str) -> None:
    with pytest.raises(error) as caught:
        messages(**body)
    assert type(caught.value) is error and caught.value.param == param  # type: ignore[attr-defined]


def test_chat_parameters_are_renamed_as_anthropic_spells_them() -> None:
    adapter = messages(messages=[{"role": "user", "content": "x"}])
    assert [adapter.param(p) for p in ("stop[2]", "stop", "max_tokens", "tools[0].function.parameters",
                                       "tools[0].function.name", "user", "messages[4]")] \
        == ["stop_sequences[2]", "stop_sequences", "max_tokens", "tools[0].input_schema", "tools[0].name",
            "metadata.user_id", "messages"]  # fmt: skip


def test_error_bodies_are_rewritten_in_anthropics_shape() -> None:
    openai_shaped = json.dumps({"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                          "code": "rate_limit_exceeded"}}).encode()  # fmt: skip
    assert json.loads(rewrite(openai_shaped, 429)) == {"type": "error", "error": {
        "message": "slow down", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}
    for status, kind in [(400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
                         (404, "not_found_error"), (413, "request_too_large"), (503, "overloaded_error"),
                         (500, "api_error"), (415, "invalid_request_error")]:  # fmt: skip
        assert json.loads(rewrite(openai_shaped, status))["error"]["type"] == kind
    assert rewrite(b"not json", 400) == b"not json"


def test_a_failed_message_stream_ends_with_anthropics_error_event() -> None:
    from inferflux.gateway.errors import ServiceUnavailable

    out = messages(messages=[{"role": "user", "content": "x"}]).streamer(HEADER)
    [(name, data)] = events_of([out.failed(ServiceUnavailable("the engine stopped"))])
    assert name == "error" and data == {"type": "error", "error": {"type": "overloaded_error", "param": None,
                                                                   "message": "the engine stopped",
                                                                   "code": "service_unavailable"}}  # fmt: skip
