"""``POST /v1/messages``: Anthropic's Messages API as an adapter over the chat path.

The request becomes a chat-completions body (``MessagesAdapter.chat_body``):
``system`` (a string or text blocks) a first system message; each message's
content a string or blocks: ``text`` blocks its text, an assistant's
``tool_use`` blocks its ``tool_calls`` (``input`` as the arguments' JSON), a
user's ``tool_result`` blocks ``tool`` messages before the rest of its text
(an ``is_error`` result's text starts with ``Error: ``, the chat format having
no flag for it); ``max_tokens`` (required, as Anthropic requires it),
``stop_sequences`` is ``stop``, ``temperature``/``top_p``/``top_k`` as they are,
``metadata.user_id`` is ``user`` (the audit event's end user),
``output_config.format`` (JSON valid against a schema) is ``response_format``
``json_schema`` (the structured outputs of the chat path); ``tools``
(``name``, ``description``, ``input_schema``) are chat function tools and
``tool_choice`` ``auto``/``any``/``tool``/``none`` is ``auto``/``required``/the
named function/``none`` (``disable_parallel_tool_use`` is
``parallel_tool_calls: false``). Refused with ``unsupported_parameter``: image
and document blocks, server tools (``web_search``, ``bash``, ...), extended
``thinking``, ``mcp_servers``, ``output_config.effort``, and a last assistant
message (a prefill to continue: the chat path always starts a new assistant turn).

The answer: a ``message`` with a ``text`` block and a ``tool_use`` block per
tool call; ``stop_reason`` ``end_turn``, ``max_tokens``, ``tool_use``,
``refusal`` (an output guardrail cut it) or ``stop_sequence`` with
``stop_sequence`` naming it (the engine's ``stop_string``; a model an upstream
serves does not report it, so there a stop on one reads as ``end_turn``).
Streams send ``message_start``, ``ping``, per block ``content_block_start``,
``content_block_delta`` (``text_delta`` or ``input_json_delta``),
``content_block_stop``, then ``message_delta`` (stop reason, usage) and
``message_stop``; an error after the first event is an ``error`` event. Error
bodies are Anthropic's (``gateway.pipeline.adapters.errors``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from inferflux.gateway.pipeline.adapters.common import BodyError, ChatReader, ToolCall, json_args, named_event, parse_body, parse_part
from inferflux.gateway.pipeline.adapters.common import ParsedRequest, unsupported
from inferflux.gateway.pipeline.adapters.errors import anthropic_error
from inferflux.gateway.pipeline.generation import Usage
from inferflux.policy.errors import ApiError

_CONFIG = ConfigDict(extra="ignore", strict=True)
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}

# A chat parameter named by an error past the translation, as this API spells it.
_RENAMES = (
    (r"^messages.*", "messages"),  # the chat messages are not Anthropic's one for one (system, tool results)
    (r"^stop", "stop_sequences"),
    (r"^(max_completion_tokens|max_tokens)$", "max_tokens"),
    (r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    (r"^tools\[(\d+)\]\.function", r"tools[\1]"),
    (r"^user$", "metadata.user_id"),
    (r"^parallel_tool_calls$", "tool_choice.disable_parallel_tool_use"),
    (r"^response_format(\.json_schema)?", "output_config.format"),
)


class _Text(BaseModel):
    model_config = _CONFIG

    type: Literal["text"]
    text: str


class _ToolUse(BaseModel):
    model_config = _CONFIG

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class _ToolResult(BaseModel):
    model_config = _CONFIG

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[dict[str, Any]] | None = None
    is_error: bool = False


class _Message(BaseModel):
    model_config = _CONFIG

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class _Tool(BaseModel):
    model_config = _CONFIG

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class _ToolChoice(BaseModel):
    model_config = _CONFIG

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, min_length=1)
    disable_parallel_tool_use: bool | None = None


class _OutputFormat(BaseModel):
    model_config = _CONFIG

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class _OutputConfig(BaseModel):
    model_config = _CONFIG

    effort: str | None = None
    format: _OutputFormat | None = None


class _Metadata(BaseModel):
    model_config = _CONFIG

    user_id: str | None = Field(default=None, max_length=256)


Block = _Text | _ToolUse | _ToolResult
_BLOCKS: dict[str, type[Block]] = {"text": _Text, "tool_use": _ToolUse, "tool_result": _ToolResult}


class MessagesRequest(BaseModel):
    """Anthropic's Messages API create body, the fields this server serves (and those it refuses by name)."""

    model_config = _CONFIG

    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1, description="user and assistant turns, content a "
                                           "string or text, tool_use and tool_result blocks")  # fmt: skip
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    metadata: _Metadata | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: _ToolChoice | None = None
    output_config: _OutputConfig | None = Field(default=None, description="format: JSON valid against a schema")
    stream: bool = False
    # Refused when given.
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(value or ()):
            if tool.get("type") not in (None, "custom"):
                raise unsupported(f"tools[{i}].type", f"tool type {str(tool.get('type'))[:40]!r} is not served: "
                                  "only custom tools (no server tools on this server)")  # fmt: skip
            parse_part(_Tool, tool, f"tools[{i}]")
        return value

    def refusals(self) -> None:
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise unsupported("thinking", "extended thinking is not served: no reasoning model here")
        if self.mcp_servers:
            raise unsupported("mcp_servers", "MCP servers are not served")
        if self.output_config is not None and self.output_config.effort is not None:
            raise unsupported("output_config.effort", "effort is not served: no reasoning model here")
        if self.tool_choice is not None and self.tool_choice.type == "tool" and self.tool_choice.name is None:
            raise BodyError("tool_choice.name", "tool_choice of type 'tool' needs the tool's name")


def parse_messages(body: dict[str, Any], model: type[MessagesRequest] = MessagesRequest) -> MessagesAdapter:
    req = parse_body(model, body)
    try:
        req.refusals()
        messages = _messages(req)
    except BodyError as exc:  # raised past pydantic's validation: the same answer
        raise exc.to_gateway() from None
    return MessagesAdapter(req, messages)


def _blocks(content: str | list[dict[str, Any]], where: str) -> list[Block]:
    if isinstance(content, str):
        return [_Text(type="text", text=content)]
    blocks = []
    for j, raw in enumerate(content):
        kind = raw.get("type")
        if kind not in _BLOCKS:
            raise unsupported(f"{where}[{j}].type", f"content blocks of type {str(kind)[:40]!r} are not served: "
                              "text, tool_use and tool_result only")  # fmt: skip
        blocks.append(parse_part(_BLOCKS[kind], raw, f"{where}[{j}]"))
    return blocks


def _text_of(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None:
        return ""
    texts = []
    for j, block in enumerate(_blocks(content, where)):
        if not isinstance(block, _Text):
            raise unsupported(f"{where}[{j}].type", f"a block of type {block.type!r} cannot stand here: text only")
        texts.append(block.text)
    return "".join(texts)


def _messages(req: MessagesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        messages.append({"role": "system", "content": _text_of(req.system, "system")})
    turns = [parse_part(_Message, m, f"messages[{i}]") for i, m in enumerate(req.messages)]
    if turns[-1].role == "assistant":
        raise unsupported(f"messages[{len(turns) - 1}]", "a last assistant message (a prefill to continue) is "
                          "not served: the answer is always a new assistant turn")  # fmt: skip
    for i, turn in enumerate(turns):
        where = f"messages[{i}].content"
        blocks = _blocks(turn.content, where)
        text = "".join(b.text for b in blocks if isinstance(b, _Text))
        if turn.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json_args(b.input)}}
                     for b in blocks if isinstance(b, _ToolUse)]  # fmt: skip
            if any(isinstance(b, _ToolResult) for b in blocks):
                raise BodyError(where, f"{where}: tool_result blocks belong in a user message")
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
            continue
        for j, block in enumerate(blocks):
            if isinstance(block, _ToolUse):
                raise BodyError(f"{where}[{j}]", f"{where}[{j}]: tool_use blocks belong in an assistant message")
            if isinstance(block, _ToolResult):
                result = _text_of(block.content, f"{where}[{j}].content")
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": f"Error: {result}" if block.is_error else result})  # fmt: skip
        if text or not any(isinstance(b, _ToolResult) for b in blocks):
            messages.append({"role": "user", "content": text})
    return messages


class MessagesAdapter(ParsedRequest):
    """One parsed Messages request: its chat body, and its answers in Anthropic's shape."""

    RENAMES = _RENAMES
    req: MessagesRequest

    def chat_body(self) -> dict[str, Any]:
        req = self.req
        body: dict[str, Any] = {"model": req.model, "messages": self.messages, "stream": req.stream}
        optional = {
            "max_tokens": req.max_tokens,  # None only for a token count, which generates nothing
            "stop": req.stop_sequences,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "user": req.metadata.user_id if req.metadata is not None else None,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        if req.tools:
            body["tools"] = [{"type": "function", "function": _function(t)} for t in req.tools]
        choice = req.tool_choice
        if choice is not None:
            names = {"auto": "auto", "any": "required", "none": "none"}
            body["tool_choice"] = names.get(choice.type) or {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if req.output_config is not None and req.output_config.format is not None:
            schema = req.output_config.format.schema_
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        return body

    def whole(self, answer: ChatReader, usage: Usage, header: dict[str, Any]) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "text", "text": answer.text}] if answer.text else []
        content += [_tool_use(call) for call in answer.tool_calls]
        message = _message(header, content, usage.prompt_tokens, usage.completion_tokens)
        return {**message, **_stop(answer.finish_reason, answer.stop_string)}

    def streamer(self, header: dict[str, Any]) -> MessageStream:
        return MessageStream(header)

    def error_end(self, exc: ApiError) -> bytes:
        return named_event("error", anthropic_error(exc.status_code, exc.message, exc.code, exc.param))


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return function


def _stop(finish_reason: str | None, stop_string: str | None) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence``: a stop on one of ``stop_sequences`` is ``stop_sequence``, naming it."""
    if finish_reason == "stop" and stop_string is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_string}
    return {"stop_reason": _STOP_REASONS.get(finish_reason or "", "end_turn"), "stop_sequence": None}


def _message(
    header: dict[str, Any], content: list[dict[str, Any]], input_tokens: int, output_tokens: int
) -> dict[str, Any]:
    return {"id": f"msg_{header['id']}", "type": "message", "role": "assistant", "model": header["model"],
            "content": content, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}  # fmt: skip


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": _arguments(call.arguments)}


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as Anthropic's ``input`` object. The chat path gives a JSON object; anything
    else (not expected) is kept whole under ``arguments`` rather than dropped."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {"arguments": text}
    value = _characters_only(value)
    return value if isinstance(value, dict) else {"arguments": value}


def _characters_only(value: Any) -> Any:
    """``value`` with each lone surrogate as U+FFFD: the model may write one escaped (``"\\ud800"``, valid
    JSON), and the object, unlike the chat path's JSON text, cannot keep it escaped in a UTF-8 answer."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.loads(re.sub("[\ud800-\udfff]", "\ufffd", text))
    return value


class MessageStream:
    """One stream's Anthropic events from the chat path's events: a block opens on its first text or call,
    and stops when the next opens or the generation ends."""

    def __init__(self, header: dict[str, Any]) -> None:
        self.header = header
        self.block = -1  # the index of the open block; -1 before the first
        self.open = False
        self.open_kind = ""
        self.finish_reason: str | None = None
        self.stop_string: str | None = None

    def opening(self) -> list[bytes]:
        started = _message(self.header, [], self.header["prompt_tokens"], 0)
        return [named_event("message_start", {"type": "message_start", "message": started}),
                named_event("ping", {"type": "ping"})]  # fmt: skip

    def translate(self, kind: str, value: Any) -> list[bytes]:
        if kind == "text":
            events = [] if self.open and self.open_kind == "text" else self._start({"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": value}
        elif kind == "tool_start":
            return self._start({"type": "tool_use", "id": value.id, "name": value.name, "input": {}})
        elif kind == "tool_args":
            events, delta = [], {"type": "input_json_delta", "partial_json": value[1]}
        else:
            self.finish_reason, self.stop_string = value
            return []
        return events + [named_event("content_block_delta", {"type": "content_block_delta", "index": self.block,
                                                             "delta": delta})]  # fmt: skip

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        events = self._stop()
        self.block += 1
        self.open, self.open_kind = True, block["type"]
        return events + [named_event("content_block_start", {"type": "content_block_start", "index": self.block,
                                                             "content_block": block})]  # fmt: skip

    def _stop(self) -> list[bytes]:
        if not self.open:
            return []
        self.open = False
        return [named_event("content_block_stop", {"type": "content_block_stop", "index": self.block})]

    def closing(self, usage: Usage) -> list[bytes]:
        stop = _stop(self.finish_reason, self.stop_string)
        delta = {"type": "message_delta", "delta": stop,
                 "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}}  # fmt: skip
        end = named_event("message_stop", {"type": "message_stop"})
        return [*self._stop(), named_event("message_delta", delta), end]

    def failed(self, exc: ApiError) -> bytes:
        return named_event("error", anthropic_error(exc.status_code, exc.message, exc.code, exc.param))
