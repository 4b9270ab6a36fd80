"""OpenAI request schemas: the generation routes' bodies, parsed and checked (``gateway.pipeline.plan`` turns them into the
engine's sampling parameters).

Unknown fields are ignored, as OpenAI does. Known OpenAI fields this server
does not implement (``functions``, ``suffix``, ...) are rejected with
``unsupported_parameter`` instead of being silently dropped, because ignoring
them would change the meaning of the request. What both routes share (the
sampling fields, stop sequences, structured outputs) is ``gateway.pipeline.sampling``.

Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant
``tool_calls`` and ``tool`` messages in the history) is checked by
``gateway.pipeline.tools``; a forced call (``required`` or a named function) becomes the
request's ``GuidedSpec``, like a ``response_format``.

Completions ``prompt`` may be a string, a list of token ids, or a list of
several strings / token-id lists; several prompts are served, and their
choices are numbered ``prompt_index * n + sample_index`` as OpenAI does. One
request fans out to at most ``MAX_CHOICES`` engine sequences (``best_of`` of
them per prompt, when it is given). ``suffix``, ``best_of`` and ``echo`` with
``logprobs`` are served as ``gateway.pipeline.completions`` describes.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from inferflux.backends.engine import GuidedSpec

from inferflux.gateway.errors import InvalidRequest, UnsupportedParameter
from inferflux.gateway.pipeline.sampling import DEFAULT_STOP_LIMITS, REQUEST_CONFIG, SamplingRequest, StopLimits, Unsupported
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

MAX_CHOICES = 16  # engine sequences one request fans out to
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETIONS = 5


# -- chat ---------------------------------------------------------------------

Role = Literal["system", "user", "assistant", "developer", "tool"]


class ChatMessage(BaseModel):
    model_config = REQUEST_CONFIG

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


class ChatCompletionRequest(SamplingRequest):
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
            raise Unsupported("top_logprobs", "top_logprobs requires logprobs to be true", code=None)
        if self.functions:
            raise Unsupported("functions", "functions (deprecated) is not supported by this server: use tools")
        if self.function_call not in (None, "none", "auto"):
            raise Unsupported("function_call", "function_call (deprecated) is not supported by this server: "
                               "use tool_choice")  # fmt: skip
        try:
            check_tools(self.tools or ())
            check_choice(self.tool_choice, self.tools)
            check_history(self.messages)
        except ToolError as exc:
            raise Unsupported(exc.param, exc.message, code=None) from None
        plan = self.tool_plan
        constraint = next((n for n in ("response_format", "guided_regex", "guided_choice") if self.asks(n)), None)
        if plan is not None and plan.mode == "forced" and constraint is not None:
            raise Unsupported(constraint, f"{constraint} cannot be combined with a forced tool_choice: give one "
                               "constraint", code=None)  # fmt: skip
        return self

    @cached_property
    def tool_plan(self) -> ToolPlan | None:
        """What the tools ask for (``gateway.pipeline.tools.tool_plan``); None when the model may not call one."""
        constrained = any(self.asks(n) for n in ("response_format", "guided_regex", "guided_choice"))
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


class CompletionRequest(SamplingRequest):
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
            raise Unsupported("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})", code=None)
        if self.stream and self.samples > self.n:
            raise Unsupported("best_of", "best_of cannot be used with stream: the best choices are known only "
                               "once every candidate has finished", code=None)  # fmt: skip
        if self.suffix and self.echo:
            raise Unsupported("echo", "echo cannot be combined with suffix", code=None)
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

GenerationRequest = ChatCompletionRequest | CompletionRequest
Req = TypeVar("Req", ChatCompletionRequest, CompletionRequest)


def parse_request(kind: type[Req], data: dict[str, Any], stop_limits: StopLimits = DEFAULT_STOP_LIMITS) -> Req:
    """``data`` (a decoded body) as a ``kind`` request; its first error the API's 400, naming the field."""
    try:
        return kind.model_validate(data, context={"stop_limits": stop_limits})
    except ValidationError as exc:
        first = first_error(exc)
        cause = first.cause  # a validator's own refusal of a known OpenAI parameter keeps its code
        if isinstance(cause, Unsupported):
            if cause.code is None:
                raise InvalidRequest(cause.message, param=cause.param) from None
            raise UnsupportedParameter(cause.message, param=cause.param, code=cause.code) from None
        raise InvalidRequest(first.line(), param=first.path) from None


def param_names(req: GenerationRequest) -> dict[str, str]:
    """Engine parameter names that the API spells differently."""
    if isinstance(req, CompletionRequest):
        return {"top_logprobs": "logprobs", "prompt_logprobs": "logprobs", "guided": req.guided_param}
    return {"max_tokens": max_tokens_param(req), "prompt": "messages", "guided": req.guided_param}


def max_tokens_param(req: GenerationRequest) -> str:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"
