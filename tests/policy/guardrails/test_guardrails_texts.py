"""Request texts out of OpenAI-shaped bodies and redacted texts back in; the block error's shape."""

from __future__ import annotations

import copy

from collections.abc import Callable

import pytest

from inferflux.policy.guardrails import ContentFiltered, Guardrails, request_texts, with_texts

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
