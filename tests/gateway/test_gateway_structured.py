"""Structured outputs and logit_bias over a real socket, with the official ``openai`` client.

``response_format`` json_schema and json_object at temperature 1.0: every one of
100 answers parses (and validates against the schema). The schema's output is
bounded (enums, strings of at most 10 characters, at most 3 tags), so
``max_tokens`` can be set above the longest answer the grammar allows and
every answer ends by itself (finish_reason "stop"). A json_object answer has no
bound (this model at temperature 1 sometimes writes a string for hundreds of
tokens): it parses all the same, because the engine closes the object as
``max_tokens`` runs out (finish_reason "length"). Seeded, so a run is
reproducible; the 100 answers are asked for at once and batched by the engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from inferflux.gateway.pipeline.json_numbers import INT_BOUND, NUMBER_BOUND
from inferflux.gateway.pipeline.plan_remote import _sampling
from inferflux.gateway.pipeline.protocol import ChatCompletionRequest, parse_request

MODEL = "smollm2-135m-instruct"
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "species": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "verified": {"type": "boolean"}},
            "required": ["city", "verified"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["cute", "loud", "old"]}, "maxItems": 3},
    },
    "required": ["name", "species", "age", "owner", "tags"],
    "additionalProperties": False,
}
PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
# The longest answer PET allows: about 100 characters of structure (keys, enums, the largest number,
# three tags: each at most one token a character), plus 20 characters of strings, each at most 6 tokens
# (a \u escape written a character a token), plus EOS: 221 tokens. 256 leaves room.
PET_MAX_TOKENS = 256
ASK_PET = [{"role": "system", "content": "You answer in JSON."},
           {"role": "user", "content": "Describe a pet as a JSON object."}]  # fmt: skip
COUNT = "How many people live in France? Answer with a JSON object."
ASK_OBJECT = [{"role": "system", "content": 'You answer with one short JSON object, like {"name": "Rex", "species": '
                                        '"dog"}.'},
              {"role": "user", "content": "Describe a pet in JSON: its name and species."}]  # fmt: skip


@pytest.fixture(scope="module")
def client(live_server: str, admin_key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server}/v1", api_key=admin_key, max_retries=0, timeout=600) as c:
        yield c


async def _hundred(live_server: str, admin_key: str, **request: Any) -> list[Any]:
    async with openai.AsyncOpenAI(base_url=f"{live_server}/v1", api_key=admin_key, max_retries=0,
                                  timeout=1200) as aclient:  # fmt: skip
        return await asyncio.gather(*(
            aclient.chat.completions.create(model=MODEL, temperature=1.0, seed=seed, **request) for seed in range(100)
        ))  # fmt: skip


def test_100_of_100_json_schema_answers_validate(live_server: str, admin_key: str) -> None:
    answers = asyncio.run(_hundred(live_server, admin_key, messages=ASK_PET, response_format=PET_FORMAT,
                                   max_tokens=PET_MAX_TOKENS))  # fmt: skip
    texts = set()
    for answer in answers:
        [choice] = answer.choices
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PET)
        texts.add(choice.message.content)
    assert len(texts) > 50  # temperature 1.0 did sample: the answers differ


def test_100_of_100_json_object_answers_parse(live_server: str, admin_key: str) -> None:
    answers = asyncio.run(_hundred(live_server, admin_key, messages=ASK_OBJECT,
                                   response_format={"type": "json_object"}, max_tokens=64))  # fmt: skip
    reasons = []
    for answer in answers:
        [choice] = answer.choices
        assert isinstance(json.loads(choice.message.content), dict), choice
        assert answer.usage.completion_tokens <= 64
        reasons.append(choice.finish_reason)
    assert set(reasons) <= {"stop", "length"} and "stop" in reasons


def test_a_streamed_json_schema_answer_validates(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=ASK_PET, response_format=PET_FORMAT, seed=5,
                                            max_tokens=PET_MAX_TOKENS, stream=True)  # fmt: skip
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PET)


@pytest.mark.parametrize("kind", ["integer", "number"])
def test_a_number_without_bounds_ends(client: openai.OpenAI, kind: str) -> None:
    """A bare integer or number has no end in its grammar, and at temperature 0 this model writes digits
    until max_tokens cuts the JSON; bounded by default (gateway.pipeline.json_numbers), the answer ends."""
    schema = {"type": "object", "properties": {"population": {"type": kind}}, "required": ["population"]}
    answer = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=64, messages=[{"role": "user", "content": COUNT}],
        response_format={"type": "json_schema", "json_schema": {"name": "count", "schema": schema}},
    )  # fmt: skip
    [choice] = answer.choices
    assert choice.finish_reason == "stop", choice.message.content
    value = json.loads(choice.message.content)["population"]
    assert abs(value) <= (INT_BOUND if kind == "integer" else NUMBER_BOUND), value
    jsonschema.validate({"population": value}, schema)


def test_the_completions_route_and_the_guided_extensions(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="A pet:", max_tokens=PET_MAX_TOKENS, seed=1,
                                    extra_body={"response_format": PET_FORMAT})  # fmt: skip
    jsonschema.validate(json.loads(out.choices[0].text), PET)
    choice = client.chat.completions.create(model=MODEL, messages=ASK_OBJECT, max_tokens=10, seed=2,
                                            extra_body={"guided_choice": ["yes", "no", "maybe so"]})  # fmt: skip
    assert choice.choices[0].message.content in ("yes", "no", "maybe so")
    regex = client.completions.create(model=MODEL, prompt="A date:", max_tokens=20, seed=3,
                                      extra_body={"guided_regex": "20[0-9]{2}-[01][0-9]-[0-3][0-9]"})  # fmt: skip
    assert len(regex.choices[0].text) == 10 and regex.choices[0].text.startswith("20")


def test_logit_bias_of_100_makes_every_token_that_token(client: openai.OpenAI, served_model: Any) -> None:
    tok = served_model.local_tokenizer
    [token] = tok.encode(" blue", add_special_tokens=False)
    answer = client.chat.completions.create(model=MODEL, messages=ASK_OBJECT, max_tokens=12, temperature=1.0,
                                            logit_bias={str(token): 100}, logprobs=True)  # fmt: skip
    [choice] = answer.choices
    assert choice.message.content == tok.decode([token] * 12)
    assert [entry.token for entry in choice.logprobs.content] == [tok.decode([token])] * 12
    assert answer.usage.completion_tokens == 12 and choice.finish_reason == "length"
    # -100 bans: greedy decoding never picks the banned token
    free = client.chat.completions.create(model=MODEL, messages=ASK_OBJECT, max_tokens=8, temperature=0)
    first = tok.encode(free.choices[0].message.content, add_special_tokens=False)[0]
    banned = client.chat.completions.create(model=MODEL, messages=ASK_OBJECT, max_tokens=8, temperature=0,
                                            logit_bias={str(first): -100}, logprobs=True)  # fmt: skip
    assert tok.decode([first]) not in [entry.token for entry in banned.choices[0].logprobs.content]


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}}}, "response_format", '"if"'),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
        ({"guided_regex": "(?=a)a"}, "guided_regex", "look-around"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "cannot be combined"),
        ({"logit_bias": {"49152": 1}}, "logit_bias", "49152"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_parameter(client: openai.OpenAI, extra: dict[str, Any],
                                                             param: str, says: str) -> None:  # fmt: skip
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK_OBJECT, max_tokens=4, extra_body=extra)
    error = caught.value.body
    assert error["param"] == param and says in error["message"], error
    assert "<state>" not in error["message"]


def test_a_remote_models_upstream_gets_response_format_and_logit_bias_as_sent() -> None:
    body = {"model": "m", "messages": ASK_OBJECT, "response_format": PET_FORMAT, "logit_bias": {"17": -5.5},
            "guided_choice": None}  # fmt: skip
    fields = _sampling(parse_request(ChatCompletionRequest, body), 0)
    assert fields["response_format"] == PET_FORMAT
    assert fields["logit_bias"] == {"17": -5.5}
    assert "guided_choice" not in fields and "guided_regex" not in fields
