"""The OpenAI API over a real socket, driven by the official ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(live_server: str, admin_key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server}/v1", api_key=admin_key, max_retries=0, timeout=120) as c:
        yield c


def test_chat_completion(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    assert resp.model == MODEL
    assert resp.system_fingerprint and resp.system_fingerprint.startswith("fp_")
    assert resp.created > 0
    [choice] = resp.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage is not None
    assert resp.usage.prompt_tokens > 10  # the chat template adds a system turn
    assert 1 <= resp.usage.completion_tokens <= 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_greedy_is_deterministic_and_alias_resolves(client: openai.OpenAI) -> None:
    a = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert b.model == MODEL  # the canonical name, as OpenAI answers with the snapshot name


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    content_chunks = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in content_chunks if c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert content_chunks[-1].choices[0].finish_reason is not None  # on the last content chunk
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_without_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices and chunks[-1].choices[0].finish_reason is not None


def test_chat_n2_with_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, n=2, seed=7, logprobs=True, top_logprobs=3
    )
    assert [c.index for c in resp.choices] == [0, 1]
    for choice in resp.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        for entry in choice.logprobs.content:
            assert entry.logprob <= 0.0
            assert len(entry.top_logprobs) == 3
            assert entry.bytes == list(entry.token.encode())
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    assert resp.usage is not None
    # The prompt is counted once, the completions of both choices summed.
    single = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert resp.usage.prompt_tokens == single.usage.prompt_tokens  # type: ignore[union-attr]
    assert resp.usage.completion_tokens == sum(len(c.logprobs.content) for c in resp.choices)  # type: ignore[union-attr]


def test_chat_stream_n2(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2, stream=True, seed=1)
    )
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    roles = {c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"}
    assert roles == {0, 1}


def test_chat_content_parts_and_developer_role(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]},
        ],
        max_completion_tokens=4,
        temperature=0,
    )
    assert resp.usage is not None and resp.usage.completion_tokens <= 4


def test_completion(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert resp.object == "text_completion"
    assert resp.id.startswith("cmpl-")
    [choice] = resp.choices
    assert choice.text
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.prompt_tokens == 5


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == full.usage.total_tokens  # type: ignore[union-attr]


def test_completion_token_ids_several_prompts_and_echo(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=3, n=2, echo=True)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.choices[0].text.startswith("Hello")
    assert resp.choices[3].text.startswith("Goodbye")
    by_ids = client.completions.create(model=MODEL, prompt=[19556], max_tokens=2, temperature=0)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == 1


def test_completion_logprobs_and_stop(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    text = resp.choices[0].text
    assert len(text) > 2
    stop = text[2]
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "inferflux"
    assert client.models.retrieve("smollm2").id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.code == "model_not_found"


def test_unknown_model_is_openai_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert info.value.code == "model_not_found"
    assert info.value.param == "model"


def test_bad_parameter_is_openai_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=5)
    assert info.value.param == "temperature"
