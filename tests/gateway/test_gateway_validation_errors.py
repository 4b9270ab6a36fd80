"""The one line a pydantic ValidationError becomes (gateway/validation_errors.py), and the OpenAI parser's use of it."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from inferflux.gateway.errors import InvalidRequest
from inferflux.gateway.pipeline.protocol import ChatCompletionRequest, parse_request
from inferflux.gateway.validation_errors import first_error, parameter_path


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    size: int | str = 0

    @field_validator("name")
    @classmethod
    def _named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("name must not be blank")
        return value


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    items: list[Item] = []
    flag: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> Body:
        if self.flag and not self.items:
            raise ValueError("flag needs items")
        return self


def _error(data: dict[str, Any]) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        Body.model_validate(data)
    return caught.value


@pytest.mark.parametrize(
    ("loc", "path"),
    [
        (("messages", 0, "content"), "messages[0].content"),
        (("prompt", "list[str]", 1), "prompt[1]"),  # a union member's tag names no field
        (("stop", "str"), "stop"),
        (("response_format", "function-after[check(), dict[str,any]]", "type"), "response_format.type"),
        ((), None),
    ],
)
def test_locations_are_written_as_parameters(loc: tuple[int | str, ...], path: str | None) -> None:
    assert parameter_path(loc) == path


def test_a_validators_message_stands_alone() -> None:
    first = first_error(_error({"items": [{"name": " "}]}))
    assert (first.path, first.message, first.type) == ("items[0].name", "name must not be blank", "value_error")
    assert first.line() == "items[0].name: name must not be blank"
    assert isinstance(first.cause, ValueError)


def test_an_unknown_field_is_named_in_the_callers_word() -> None:
    exc = _error({"items": [{"name": "a", "colour": "red"}]})
    assert first_error(exc).line() == "items[0].colour: unknown field"
    assert first_error(exc, unknown="unknown setting").line() == "items[0].colour: unknown setting"
    assert first_error(exc).loc == ("items", 0, "colour")


def test_an_error_of_the_whole_body_has_no_path() -> None:
    first = first_error(_error({"flag": True}))
    assert first.path is None and first.line() == "flag needs items"


def test_union_members_do_not_show_in_the_path() -> None:
    first = first_error(_error({"items": [{"name": "a", "size": 1.5}]}))
    assert first.path == "items[0].size"


def test_the_openai_parser_names_the_parameter() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InvalidRequest) as caught:
        parse_request(ChatCompletionRequest, {**base, "messages": [{"role": "user", "content": 5}]})
    assert caught.value.param is not None and caught.value.param.startswith("messages[0].content")
    with pytest.raises(InvalidRequest) as caught:
        parse_request(ChatCompletionRequest, {**base, "speculative": {"depth": 3}})
    assert (caught.value.param, caught.value.message) == ("speculative.depth", "speculative.depth: unknown field")
