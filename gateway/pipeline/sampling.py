"""What a chat and a text completion's bodies share: the sampling fields, stop sequences, the output's constraint.

``gateway.pipeline.protocol`` builds the two APIs' requests on ``SamplingRequest``
and parses them; a validator here refuses a field with ``Unsupported``, which
the parser turns into the API's error naming that field.

Structured outputs: ``response_format`` ``json_object`` and ``json_schema``
(and vLLM's ``guided_regex`` and ``guided_choice``), on both routes, become the
engine's ``GuidedSpec``; at most one of them per request. ``logit_bias`` keys
are token ids written as strings (JSON keys are strings), made integers here;
the engine checks them against the vocabulary, the count and the range.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from inferflux.backends.engine import GuidedSpec

from inferflux.gateway.pipeline.json_numbers import bounded_numbers
from inferflux.gateway.pipeline.json_schema import closed_schema

MAX_N = 8  # choices a prompt may ask for (n)

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


@dataclass(frozen=True, slots=True)
class StopLimits:
    """How many stop sequences a request may give, and how long each (``input_limits`` settings)."""

    max_sequences: int = 16
    max_bytes: int = 512


DEFAULT_STOP_LIMITS = StopLimits()


# strict: OpenAI rejects "max_tokens": true or "n": "2"; pydantic's lax mode would
# quietly turn them into 1 and 2.
REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG

    include_usage: bool = False


class SpeculativeRequest(BaseModel):
    """The ``speculative`` extension: this request's share of the model's speculative decoding."""

    model_config = ConfigDict(extra="forbid", strict=True)

    method: Literal["ngram", "draft"] | None = None
    k: int | None = Field(default=None, ge=0, le=16)  # 0: off for this request; n: drafts of at most n tokens


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's shape. The schema is always enforced, whatever ``strict`` says,
    with objects closed to the properties they list (``gateway.pipeline.json_schema``)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: plain text, any JSON object, or JSON valid against a schema."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_format(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise Unsupported("response_format.json_schema", "response_format of type 'json_schema' needs "
                               "a json_schema object", code=None)  # fmt: skip
        return self

    def guided(self) -> GuidedSpec | None:
        if self.type == "json_object":
            return GuidedSpec("json_object")
        if self.type == "json_schema" and self.json_schema is not None:
            schema = self.json_schema.schema_
            # No schema: any JSON value (OpenAI leaves it optional). Objects closed to their listed
            # properties (gateway.pipeline.json_schema), numbers bounded (gateway.pipeline.json_numbers):
            # the answer still validates against the client's schema.
            return GuidedSpec("json_schema", schema={} if schema is None else closed_schema(bounded_numbers(schema)))
        return None


class SamplingRequest(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = REQUEST_CONFIG

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = Field(default=None, description="Token id (a string) -> a number from "
                                                "-100 to 100 added to its logit; at most 300 entries")
    user: str | None = Field(default=None, max_length=256)
    # Extensions beyond the OpenAI API (vLLM spells them the same way).
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    # Lower is more important; bounded per caller by its traffic policy (gateway.pipeline.policy.RequestPolicy.place).
    priority: int = Field(default=0, description="Engine priority: lower is more important. By default a caller "
                          "may ask for 0 to 1000; its traffic policy's min_priority/max_priority can widen that")
    speculative: SpeculativeRequest | None = None
    # Structured outputs (OpenAI's response_format; vLLM's guided_regex and guided_choice).
    response_format: ResponseFormat | None = None
    guided_regex: str | None = Field(default=None, min_length=1, description="The output must match this "
                                     "regular expression (Rust regex syntax: no look-around or back-references)")
    guided_choice: list[str] | None = Field(default=None, min_length=1, description="The output must be exactly "
                                            "one of these strings")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None, info: ValidationInfo) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        limits: StopLimits = (info.context or {}).get("stop_limits", DEFAULT_STOP_LIMITS)
        if len(stops) > limits.max_sequences:
            raise ValueError(f"at most {limits.max_sequences} stop sequences are allowed")
        for i, stop in enumerate(stops):
            where = "stop" if isinstance(value, str) else f"stop[{i}]"
            if stop == "":
                raise Unsupported(where, "stop sequences must not be empty", code=None)
            # Every step of the sequence searches for each stop string in the text it holds back.
            if len(stop.encode("utf-8")) > limits.max_bytes:
                raise Unsupported(where, f"a stop sequence may be at most {limits.max_bytes} bytes (UTF-8)",
                                   code=None)  # fmt: skip
        return value

    @model_validator(mode="after")
    def _check_common(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise Unsupported("stream_options", "stream_options is only allowed when stream is true", code=None)
        for key in self.logit_bias or {}:
            if not _TOKEN_ID.fullmatch(key):
                raise Unsupported("logit_bias", f"logit_bias keys must be token ids (integers, as strings); "
                                   f"got {key[:40]!r}", code=None)  # fmt: skip
        asked = [name for name in ("response_format", "guided_regex", "guided_choice") if self.asks(name)]
        if len(asked) > 1:
            raise Unsupported(asked[1], f"{asked[1]} cannot be combined with {asked[0]}: give one constraint",
                               code=None)  # fmt: skip
        return self

    def asks(self, name: str) -> bool:
        """Whether the request asks for the constraint ``name`` (a ``response_format`` of type text asks none)."""
        if name == "response_format":
            return self.response_format is not None and self.response_format.type != "text"
        return getattr(self, name) is not None

    @property
    def guided_param(self) -> str:
        """The field that carries this request's constraint (the engine calls it ``guided``)."""
        return next((n for n in ("guided_regex", "guided_choice") if self.asks(n)), "response_format")

    def guided(self) -> GuidedSpec | None:
        """The engine's form of the request's constraint; None for free text."""
        if self.guided_regex is not None:
            return GuidedSpec("regex", pattern=self.guided_regex)
        if self.guided_choice is not None:
            return GuidedSpec("choice", choices=tuple(self.guided_choice))
        return None if self.response_format is None else self.response_format.guided()

    @property
    def token_logit_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer keys (checked: ``_check_common``)."""
        if not self.logit_bias:
            return None
        return {int(key): value for key, value in self.logit_bias.items()}

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def prompt_logprobs(self) -> int | None:
        """The prompt's own logprobs, with this many alternatives each (the completions route's echo); None: off."""
        return None

    @property
    def samples(self) -> int:
        """Sequences generated per prompt (``best_of`` of them on the completions route)."""
        return self.n


_TOKEN_ID = re.compile(r"[0-9]{1,10}")


class Unsupported(ValueError):
    """Raised inside validators; converted to an ``UnsupportedParameter`` with its own param."""

    def __init__(self, param: str, message: str, code: str | None = "unsupported_parameter") -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code
