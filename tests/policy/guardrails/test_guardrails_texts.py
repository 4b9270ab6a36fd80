"""Request texts out of OpenAI-shaped bodies and redacted texts back in; the block error's shape; the tool surface."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import pytest

from inferflux.policy.guardrails import Action, ContentFiltered, Guardrails, request_texts, with_texts
from inferflux.policy.guardrails.errors import InvalidText
from inferflux.policy.guardrails.screen import screen_body
from inferflux.policy.guardrails.texts import collect

CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": [{"type": "text", "text": "mail bob@example.com"}, {"type": "image_url"}]},
        {"role": "assistant", "content": None},
    ],
}


def test_chat_texts_round_trip(make_guardrails: Callable[..., Guardrails]) -> None:
    assert request_texts(CHAT) == ["be nice", "mail bob@example.com"]
    decision = make_guardrails({"pii": {"email": "redact"}}).check_input(request_texts(CHAT))
    before = copy.deepcopy(CHAT)
    body = with_texts(CHAT, decision.texts)
    assert CHAT == before
    assert body["messages"][1]["content"][0]["text"] == "mail [EMAIL]"
    assert CHAT["messages"][1]["content"][0]["text"] == "mail bob@example.com"  # the original is untouched
    assert decision.findings[0].index == 1


@pytest.mark.parametrize(
    ("body", "texts", "upper"),
    [
        ({"prompt": "a"}, ["a"], {"prompt": "A"}),
        ({"prompt": ["a", "b"]}, ["a", "b"], {"prompt": ["A", "B"]}),
        ({"prompt": [1, 2]}, [], {"prompt": [1, 2]}),  # token ids are not text
        ({}, [], {}),
        # Embeddings' input, the same shapes.
        ({"input": "a"}, ["a"], {"input": "A"}),
        ({"input": ["a", "b"], "model": "m"}, ["a", "b"], {"input": ["A", "B"], "model": "m"}),
        ({"input": [[1, 2], [3]]}, [], {"input": [[1, 2], [3]]}),
    ],
)
def test_completion_prompts_and_embedding_inputs(body: dict[str, object], texts: list[str], upper: dict[str, object]) -> None:
    before = copy.deepcopy(body)
    assert request_texts(body) == texts
    assert with_texts(body, [t.upper() for t in texts]) == upper
    assert body == before  # the original is untouched


def test_wrong_number_of_texts_is_refused() -> None:
    with pytest.raises(ValueError):
        with_texts(CHAT, ["one"])


def test_block_error_is_openai_shaped_and_does_not_echo(make_guardrails: Callable[..., Guardrails]) -> None:
    decision = make_guardrails({"pii": {"ssn": "block", "email": "log"}}).check_input(["ssn 123-45-6789, a@b.io"])
    error = decision.error()
    assert isinstance(error, ContentFiltered)
    assert (error.status_code, error.error_type, error.code) == (400, "invalid_request_error", "content_filter")
    assert "123-45-6789" not in error.message and "a@b.io" not in error.message
    assert "rule 'pii.ssn'" in error.message and "pii.email" not in error.message
    assert [f.to_dict()["type"] for f in error.findings] == ["ssn", "email"]
    assert error.reasons == decision.reasons


# -- the tool surface (issue 44) ---------------------------------------------------------------------

CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Paris", "n": 4111111111111111}'}}
TOOLS_BODY = {
    "model": "m",
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "blue"}, {"type": "text", "text": "bird"}], "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ],
    "tools": [{"type": "function", "function": {"name": "lookup", "description": "Find", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z]"}}, "required": ["city"],
        "$defs": {"unit": {"enum": ["c", 12]}}}}}],
}  # fmt: skip


def test_every_string_that_reaches_the_model_is_collected() -> None:
    collected = collect(TOOLS_BODY)
    texts = dict(zip(collected.slots, collected.texts, strict=True))
    fixed = {collected.slots[k] for k in collected.fixed}
    assert texts == {
        ("messages", 0, "content", 0): "blue", ("messages", 0, "content", 1): "bird", ("messages", 2): "sunny",
        ("messages", 0, "name"): "ann", ("messages", 2, "tool_call_id"): "call_1",
        ("calls", 1, 0, "id"): "call_1", ("calls", 1, 0, "name"): "lookup",
        ("calls", 1, 0, "key", "city"): "city", ("calls", 1, 0, "value", "city"): "Paris",
        ("calls", 1, 0, "key", "n"): "n", ("calls", 1, 0, "value", "n"): "4111111111111111",  # a card-length number
        ("tools", 0, "name"): "lookup", ("tools", 0, "description"): "Find",
        # JSON Schema's keywords as keys, and "object" or "string" as a type, are its syntax: not read.
        ("tools", 0, "key", "properties", "city"): "city",
        ("tools", 0, "value", "properties", "city", "pattern"): "^[A-Z]",
        ("tools", 0, "value", "required", 0): "city",
        ("tools", 0, "key", "$defs", "unit"): "unit", ("tools", 0, "value", "$defs", "unit", "enum", 0): "c",
    }  # fmt: skip
    # Names, ids, keys and the schema's machinery cannot be rewritten; descriptions, enums and values can.
    assert fixed == {slot for slot in texts if slot[-1] in ("name", "tool_call_id", "id", "pattern") or "key" in slot
                     or slot[-2:-1] == ("required",)}  # fmt: skip
    # Read as one: a message's parts; a call's last string and its result.
    last = collected.slots.index(("calls", 1, 0, "value", "n"))
    assert collected.groups == [(0, 1), (last, collected.slots.index(("messages", 2)))]


def test_a_lone_surrogate_in_a_calls_arguments_is_invalid_text() -> None:
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": '{"\\udc00": 1}'}}]}]}  # fmt: skip
    with pytest.raises(InvalidText) as caught:
        collect(body)
    assert (caught.value.status_code, caught.value.code, caught.value.param) == (
        400, "invalid_unicode", "messages[0].tool_calls[0].function.arguments")


def test_a_redacted_number_becomes_its_placeholder_and_others_stay_numbers(make_guardrails: Callable[..., Guardrails]) -> None:
    screened = screen_body(make_guardrails({"pii": {"card": "redact"}}), TOOLS_BODY)
    assert screened.decision is not None and screened.decision.redacted and not screened.decision.blocked
    arguments = json.loads(screened.body["messages"][1]["tool_calls"][0]["function"]["arguments"])
    assert arguments == {"city": "Paris", "n": "[CARD]"}
    assert screened.body["tools"] == TOOLS_BODY["tools"]  # untouched: 12 is no card


@pytest.mark.parametrize("where", ["tool name", "property name", "call id"])
def test_a_redaction_of_a_text_that_cannot_be_rewritten_refuses(make_guardrails: Callable[..., Guardrails],
                                                                 where: str) -> None:  # fmt: skip
    body = copy.deepcopy(TOOLS_BODY)
    if where == "tool name":
        body["tools"][0]["function"]["name"] = "mail_bob@example.com"
    elif where == "property name":
        body["tools"][0]["function"]["parameters"]["properties"]["bob@example.com"] = {"type": "string"}
    else:
        body["messages"][1]["tool_calls"][0]["id"] = "bob@example.com"
    decision = screen_body(make_guardrails({"pii": {"email": "redact"}}), body).decision
    assert decision is not None and decision.blocked
    fixed = collect(body).fixed
    on_fixed = [f.action for f in decision.findings if f.index in fixed]
    assert on_fixed and set(on_fixed) == {Action.BLOCK}


def test_token_ids_are_read_with_the_decoder_or_refused(make_guardrails: Callable[..., Guardrails]) -> None:
    guards = make_guardrails({"blocklist": [{"id": "w", "literal": "bluebird"}]})
    words = {1: "a ", 2: "blue", 3: "bird"}
    body = {"model": "m", "input": [[1, 2], [1, 2, 3]]}
    decision = screen_body(guards, body, lambda ids: "".join(words[i] for i in ids)).decision
    assert decision is not None and decision.blocked and decision.findings[0].index == 1
    with pytest.raises(InvalidText) as caught:
        screen_body(guards, body)  # nothing to decode them with: refused, never let through unread
    assert (caught.value.code, caught.value.param) == ("token_ids_unchecked", "input[0]")
    # A tenant without input guardrails is not asked to decode anything.
    assert screen_body(make_guardrails({}), body).decision is None
    assert collect({"prompt": [5, 6]}).texts == []
