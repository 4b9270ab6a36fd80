"""OpenAI request schemas: the generation routes' bodies, parsed and checked (``gateway.pipeline.plan`` turns them into the
engine's sampling parameters).

Unknown fields are ignored, as OpenAI does. Known OpenAI fields this server
does not implement (``functions``, ``suffix``, ...) are rejected with
``unsupported_parameter`` instead of being silently dropped, because ignoring
them would change the meaning of the request.

Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant
``tool_calls`` and ``tool`` messages in the history) is checked by
``gateway.pipeline.tools``; a forced call (``required`` or a named function) becomes the
request's ``GuidedSpec``, like a ``response_format``.

Structured outputs: ``response_format`` ``json_object`` and ``json_schema``
(and vLLM's ``guided_regex`` and ``guided_choice``), on both routes, become the
engine's ``GuidedSpec``; at most one of them per request. ``logit_bias`` keys
are token ids written as strings (JSON keys are strings), made integers here;
the engine checks them against the vocabulary, the count and the range.

Completions ``prompt`` may be a string, a list of token ids, or a list of
several strings / token-id lists; several prompts are served, and their
choices are numbered ``prompt_index * n + sample_index`` as OpenAI does. One
request fans out to at most ``MAX_CHOICES`` engine sequences (``best_of`` of
them per prompt, when it is given). ``suffix``, ``best_of`` and ``echo`` with
``logprobs`` are served as ``gateway.pipeline.completions`` describes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from inferflux.backends.engine import GuidedSpec

from inferflux.gateway.errors import InvalidRequest, UnsupportedParameter
from inferflux.gateway.pipeline.json_schema import closed_schema
from inferflux.gateway.pipeline.tools import (
    ToolCall,
    ToolChoice,
    ToolDefinition,
    ToolError,
    ToolPlan,
    call_names,
    check_choice,
    check_history,
    check_tools,
    template_calls,
    template_tools,
    tool_plan,
)
from inferflux.gateway.validation_errors import first_error

MAX_N = 8
MAX_CHOICES = 16
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETIONS = 5

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


@dataclass(frozen=True, slots=True)
class StopLimits:
    """How many stop sequences a request may give, and how long each (``input_limits`` settings)."""

    max_sequences: int = 16
    max_bytes: int = 512


DEFAULT_STOP_LIMITS = StopLimits()


# strict: OpenAI rejects "max_tokens": true or "n": "2"; pydantic's lax mode would
# quietly turn them into 1 and 2.
_REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG

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
            raise _Unsupported("response_format.json_schema", "response_format of type 'json_schema' needs "
                               "a json_schema object", code=None)  # fmt: skip
        return self

    def guided(self) -> GuidedSpec | None:
        if self.type == "json_object":
            return GuidedSpec("json_object")
        if self.type == "json_schema" and self.json_schema is not None:
            schema = self.json_schema.schema_
            # No schema: any JSON value (OpenAI leaves it optional). Objects closed to their listed
            # properties (gateway.pipeline.json_schema): the answer still validates against the client's schema.
            return GuidedSpec("json_schema", schema={} if schema is None else closed_schema(schema))
        return None


class _SamplingRequest(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = _REQUEST_CONFIG

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
                raise _Unsupported(where, "stop sequences must not be empty", code=None)
            # Every step of the sequence searches for each stop string in the text it holds back.
            if len(stop.encode("utf-8")) > limits.max_bytes:
                raise _Unsupported(where, f"a stop sequence may be at most {limits.max_bytes} bytes (UTF-8)",
                                   code=None)  # fmt: skip
        return value

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise _Unsupported("stream_options", "stream_options is only allowed when stream is true", code=None)
        for key in self.logit_bias or {}:
            if not _TOKEN_ID.fullmatch(key):
                raise _Unsupported("logit_bias", f"logit_bias keys must be token ids (integers, as strings); "
                                   f"got {key[:40]!r}", code=None)  # fmt: skip
        asked = [name for name in ("response_format", "guided_regex", "guided_choice") if self._asks(name)]
        if len(asked) > 1:
            raise _Unsupported(asked[1], f"{asked[1]} cannot be combined with {asked[0]}: give one constraint",
                               code=None)  # fmt: skip
        return self

    def _asks(self, name: str) -> bool:
        if name == "response_format":
            return self.response_format is not None and self.response_format.type != "text"
        return getattr(self, name) is not None

    @property
    def guided_param(self) -> str:
        """The field that carries this request's constraint (the engine calls it ``guided``)."""
        return next((n for n in ("guided_regex", "guided_choice") if self._asks(n)), "response_format")

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


class _Unsupported(ValueError):
    """Raised inside validators; converted to an ``UnsupportedParameter`` with its own param."""

    def __init__(self, param: str, message: str, code: str | None = "unsupported_parameter") -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code


# -- chat ---------------------------------------------------------------------

Role = Literal["system", "user", "assistant", "developer", "tool"]


class ChatMessage(BaseModel):
    model_config = _REQUEST_CONFIG

    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)

    @field_validator("content")
    @classmethod
    def _check_parts(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(value, list):
            for j, part in enumerate(value):
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"content part {j} has type {kind!r}; only 'text' parts are supported")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {j} must have a string 'text'")
        return value

    @model_validator(mode="after")
    def _check_message(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message may have tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' message needs the tool_call_id of the call it answers")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message must have content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)

    def to_template(self) -> dict[str, Any]:
        # Open-weight chat templates know "system" but not OpenAI's newer
        # "developer" role, which means the same thing.
        role = "system" if self.role == "developer" else self.role
        rendered: dict[str, Any] = {"role": role, "content": self.text()}
        if self.name is not None:
            rendered["name"] = self.name
        if self.tool_call_id is not None:
            rendered["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            rendered["tool_calls"] = template_calls(self.tool_calls)
            if self.content is None:
                rendered["content"] = None  # templates test for it ("if message.content")
        return rendered


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS_CHAT)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated forerunners of tools; rejected when meaningful.
    functions: list[Any] | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _Unsupported("top_logprobs", "top_logprobs requires logprobs to be true", code=None)
        if self.functions:
            raise _Unsupported("functions", "functions (deprecated) is not supported by this server: use tools")
        if self.function_call not in (None, "none", "auto"):
            raise _Unsupported("function_call", "function_call (deprecated) is not supported by this server: "
                               "use tool_choice")  # fmt: skip
        try:
            check_tools(self.tools or ())
            check_choice(self.tool_choice, self.tools)
            check_history(self.messages)
        except ToolError as exc:
            raise _Unsupported(exc.param, exc.message, code=None) from None
        plan = self.tool_plan
        constraint = next((n for n in ("response_format", "guided_regex", "guided_choice") if self._asks(n)), None)
        if plan is not None and plan.mode == "forced" and constraint is not None:
            raise _Unsupported(constraint, f"{constraint} cannot be combined with a forced tool_choice: give one "
                               "constraint", code=None)  # fmt: skip
        return self

    @cached_property
    def tool_plan(self) -> ToolPlan | None:
        """What the tools ask for (``gateway.pipeline.tools.tool_plan``); None when the model may not call one."""
        constrained = any(self._asks(n) for n in ("response_format", "guided_regex", "guided_choice"))
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls, constrained)

    @property
    def guided_param(self) -> str:
        plan = self.tool_plan
        return "tool_choice" if plan is not None and plan.mode == "forced" else super().guided_param

    def guided(self) -> GuidedSpec | None:
        plan = self.tool_plan
        return plan.spec if plan is not None and plan.mode == "forced" else super().guided()

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt describes: none with tool_choice "none" (the model must not call)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return template_tools(self.tools)

    @property
    def has_tool_history(self) -> bool:
        return any(m.tool_calls or m.role == "tool" for m in self.messages)

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens supersedes the deprecated max_tokens.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def template_messages(self) -> list[dict[str, Any]]:
        messages = [m.to_template() for m in self.messages]
        if self.has_tool_history:
            names = call_names(messages)  # some templates write a tool result's function name
            for message in messages:
                if message["role"] == "tool" and "name" not in message and message.get("tool_call_id") in names:
                    message["name"] = names[message["tool_call_id"]]
        return messages


# -- completions --------------------------------------------------------------

PromptInput = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptInput
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS_COMPLETIONS)
    suffix: str | None = Field(default=None, description="Text after the completion (fill-in-the-middle): only "
                               "for a model whose tokenizer has fill-in-the-middle tokens")
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES, description="Candidates generated per "
                                "prompt, of which the n with the highest mean logprob per token are returned; "
                                "not with stream")

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        # Checked by hand: a union error from pydantic lists every alternative,
        # which says little about what was wrong.
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of those")
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return value
        if all(isinstance(v, str) for v in value):
            return value
        if all(isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v) for v in value):
            return value
        raise ValueError("prompt must be a string, a list of token ids, or a list of strings or of token-id lists")

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise _Unsupported("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})", code=None)
        if self.stream and self.samples > self.n:
            raise _Unsupported("best_of", "best_of cannot be used with stream: the best choices are known only "
                               "once every candidate has finished", code=None)  # fmt: skip
        if self.suffix and self.echo:
            raise _Unsupported("echo", "echo cannot be combined with suffix", code=None)
        return self

    @property
    def samples(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    @property
    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @property
    def requested_max_tokens(self) -> int:
        # The legacy completions API defaults to 16 tokens.
        return self.max_tokens if self.max_tokens is not None else 16

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s), each a string or a token-id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# -- parsing ------------------------------------------------------------------


def parse_request(
    model_cls: type[_SamplingRequest], data: dict[str, Any], stop_limits: StopLimits = DEFAULT_STOP_LIMITS
) -> Any:
    try:
        return model_cls.model_validate(data, context={"stop_limits": stop_limits})
    except ValidationError as exc:
        first = first_error(exc)
        cause = first.cause  # a validator's own refusal of a known OpenAI parameter keeps its code
        if isinstance(cause, _Unsupported):
            if cause.code is None:
                raise InvalidRequest(cause.message, param=cause.param) from None
            raise UnsupportedParameter(cause.message, param=cause.param, code=cause.code) from None
        raise InvalidRequest(first.line(), param=first.path) from None
