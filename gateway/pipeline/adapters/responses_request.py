"""The body of ``POST /v1/responses``: the fields served, those refused by name, and its input as chat messages.

``ResponsesRequest`` checks the body (function tools only, a ``tool_choice``
that names a function) and ``refusals`` names the first field that needs state
or a feature this server does not have; ``chat_messages`` turns
``instructions`` and the ``input`` items into the chat path's messages. The
rest of the translation, and the answer, is ``gateway.pipeline.adapters.responses``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from inferflux.gateway.pipeline.adapters.common import BodyError, parse_part, unsupported

_CONFIG = ConfigDict(extra="ignore", strict=True)
_PART_TEXT = {"input_text": "text", "output_text": "text", "refusal": "refusal"}  # part type -> its text field
_STATELESS = ("this server keeps no responses or conversations (stateless subset of the Responses API)")


class _Part(BaseModel):
    model_config = _CONFIG

    type: str
    text: str | None = None
    refusal: str | None = None


class _MessageItem(BaseModel):
    model_config = _CONFIG

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class _FunctionCallItem(BaseModel):
    model_config = _CONFIG

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1)
    arguments: str


class _FunctionOutputItem(BaseModel):
    model_config = _CONFIG

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[dict[str, Any]]


class _FunctionTool(BaseModel):
    model_config = _CONFIG

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Format(BaseModel):
    """``text.format``: the chat path's ``response_format``, flattened (``name``/``schema`` beside ``type``)."""

    model_config = _CONFIG

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "description": self.description, "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class _Text(BaseModel):
    model_config = _CONFIG

    format: _Format | None = None


Item = _MessageItem | _FunctionCallItem | _FunctionOutputItem


class ResponsesRequest(BaseModel):
    """The Responses API's create body, the fields this server serves (and those it refuses by name)."""

    model_config = _CONFIG

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(description="A user message, or message, function_call and "
                                              "function_call_output items")  # fmt: skip
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = Field(default=None, description="Function tools only")
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: _Text | None = None
    stream: bool = False
    store: bool | None = Field(default=None, description="Accepted; nothing is stored (answers say false)")
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    # Refused when given: each needs state, a hosted feature or a model this server does not have.
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    include: list[Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("input must be a string or a non-empty list of items")
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise BodyError(f"input[{i}]", f"input[{i}]: an item must be an object")
        return value

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(value or ()):
            if tool.get("type") != "function":
                raise unsupported(f"tools[{i}].type", f"tool type {str(tool.get('type'))[:40]!r} is not served: "
                                  "only function tools (no hosted tools on this server)")  # fmt: skip
            parse_part(_FunctionTool, tool, f"tools[{i}]")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(value, str) and value not in ("none", "auto", "required"):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")
        if isinstance(value, dict):
            if value.get("type") != "function":
                raise unsupported("tool_choice", f"tool_choice of type {str(value.get('type'))[:40]!r} is not "
                                  "served: only function tools")  # fmt: skip
            if not isinstance(value.get("name"), str) or not value["name"]:
                raise BodyError("tool_choice.name", "tool_choice.name must be a function's name")
        return value

    def refusals(self) -> None:
        """``unsupported_parameter`` for the first field given that this server does not serve."""
        reasons = {
            "previous_response_id": _STATELESS,
            "conversation": _STATELESS,
            "background": "background responses need stored state; " + _STATELESS,
            "prompt": "stored prompt templates are not served",
            "include": "no extra output (logprobs, encrypted reasoning, tool sources) is served",
            "max_tool_calls": "max_tool_calls is not served",
            "top_logprobs": "logprobs are not served on /v1/responses",
        }
        for name, reason in reasons.items():
            value = getattr(self, name)
            if value not in (None, False, [], 0):
                raise unsupported(name, reason)
        if self.truncation == "auto":
            raise unsupported("truncation", "truncation 'auto' is not served: a conversation too long for the "
                              "context is refused, never cut")  # fmt: skip
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise unsupported("reasoning", "reasoning options are not served: no reasoning model here")

    def items(self) -> list[Item]:
        if isinstance(self.input, str):
            return [_MessageItem(role="user", content=self.input)]
        return [_item(item, i) for i, item in enumerate(self.input)]


def _item(item: dict[str, Any], i: int) -> Item:
    where = f"input[{i}]"
    kind = item.get("type", "message" if "role" in item else None)
    models: dict[Any, type[Item]] = {"message": _MessageItem, "function_call": _FunctionCallItem,
                                     "function_call_output": _FunctionOutputItem}  # fmt: skip
    if kind not in models:
        raise unsupported(f"{where}.type", f"input item type {str(kind)[:40]!r} is not served: only message, "
                          "function_call and function_call_output items (stateless)")  # fmt: skip
    return parse_part(models[kind], item, where)


def _parts_text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, raw in enumerate(content):
        part = parse_part(_Part, raw, f"{where}[{j}]")
        field = _PART_TEXT.get(part.type)
        if field is None:
            raise unsupported(f"{where}[{j}].type", f"content of type {part.type[:40]!r} is not served: text only")
        text = getattr(part, field)
        if text is None:
            raise BodyError(f"{where}[{j}].{field}", f"a part of type {part.type!r} needs a string {field!r}")
        texts.append(text)
    return "".join(texts)


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` as a first system message, then each input item as its chat message."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    for i, item in enumerate(req.items()):
        if isinstance(item, _MessageItem):
            messages.append({"role": item.role, "content": _parts_text(item.content, f"input[{i}].content")})
        elif isinstance(item, _FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # Parallel calls, or a turn's text and then its calls: one assistant turn.
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            output = _parts_text(item.output, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages
