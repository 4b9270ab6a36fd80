"""What the two vendor adapters share: body parsing, parameter renaming, the chat stream read as events.

An adapter (``gateway.pipeline.adapters.responses``, ``gateway.pipeline.adapters.anthropic``)
is the request path's translator at both ends of the chat-completions path:
its vendor's body becomes a chat-completions body, which the chat route's own
steps (input guardrails, parse, allow-list, placement, plan, limits, OPA,
generation, output guardrails, settlement, audit) take as they take any other;
the OpenAI-shaped answer (``ChatRenderer``'s object, or its stream chunks)
comes back in the vendor's shape. Nothing is decided here: a tool call, a
stop or a content filter is whatever the chat path made of it.

- ``parse_body``: a vendor body through its pydantic model; the first error is a
  400 naming the vendor's field (``input[2].content[0].text``), a known field
  this server does not serve a 400 ``unsupported_parameter``.
- ``rename``: a chat parameter named by an error raised past the translation
  (``stop[1]``, ``max_completion_tokens``) as the vendor's body spells it.
- ``ChatReader``: the chat stream's chunks as text, tool-call and finish events,
  and the message they add up to (what a vendor's last event repeats whole).
- ``AdapterRenderer``: the ``Renderer`` the chat route answers with, whole or as
  the vendor's named SSE events.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from inferflux.gateway.errors import GatewayError, InvalidRequest, UnsupportedParameter
from inferflux.gateway.pipeline.generation import ChoiceEvent, Generation, Usage
from inferflux.gateway.pipeline.render import ChatRenderer, stream_chunks
from inferflux.gateway.pipeline.sse import SSELast, sse_data
from inferflux.gateway.validation_errors import first_error
from inferflux.policy.errors import ApiError

if TYPE_CHECKING:
    from inferflux.backends.engine import RequestOutput

    from inferflux.gateway.pipeline.plan import Plan

M = TypeVar("M", bound=BaseModel)


class BodyError(ValueError):
    """Raised inside a vendor model's validators: a 400 naming ``param`` (``unsupported_parameter`` with ``code``)."""

    def __init__(self, param: str, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code

    def to_gateway(self) -> GatewayError:
        if self.code is not None:
            return UnsupportedParameter(self.message, param=self.param, code=self.code)
        return InvalidRequest(self.message, param=self.param)


def unsupported(param: str, message: str) -> BodyError:
    return BodyError(param, message, code="unsupported_parameter")


def parse_body(model: type[M], body: Any, where: str = "") -> M:
    """``body`` validated by ``model``; a ``GatewayError`` naming the first bad field otherwise.

    ``where`` prefixes the path when a part of a body is validated on its own
    (an input item, a content block), so errors still name the whole path.
    """
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = first_error(exc)
        if isinstance(first.cause, BodyError):
            raise first.cause.to_gateway() from None
        path = _join(where, first.path)
        raise InvalidRequest(f"{path}: {first.message}" if path else first.message, param=path or None) from None


def parse_part(model: type[M], value: Any, where: str) -> M:
    """``parse_body`` inside a validator: the part's error as a ``BodyError``, which keeps its path through pydantic."""
    try:
        return parse_body(model, value, where)
    except GatewayError as exc:
        raise BodyError(exc.param or where, exc.message, code=exc.code if isinstance(exc, UnsupportedParameter)
                        else None) from None  # fmt: skip


def _join(where: str, path: str | None) -> str:
    if not path:
        return where
    if not where:
        return path
    return f"{where}{path}" if path.startswith("[") else f"{where}.{path}"


def rename(param: str | None, table: Sequence[tuple[str, str]]) -> str | None:
    """``param`` with its leading chat parameter replaced by the vendor's (``table``: regex -> replacement,
    the first that matches wins); unchanged when none matches."""
    if param is None:
        return None
    for pattern, replacement in table:
        renamed, count = re.subn(pattern, replacement, param, count=1)
        if count:
            return renamed
    return param


def json_args(value: Any) -> str:
    """Tool-call arguments as the chat path carries them: a JSON text (compact, as the model writes it)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def named_event(name: str, payload: dict[str, Any]) -> bytes:
    """One SSE event with its name, as both vendors' streams send every event."""
    return f"event: {name}\ndata: {sse_data(payload)}\n\n".encode()


# -- the chat answer, read back -------------------------------------------------------


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""


@dataclass
class ChatReader:
    """The chat stream's chunks as what happened (``text``, ``tool_start``, ``tool_args``, ``finish`` with the
    finish reason and stop string), and the message so far; one choice (the adapters ask for ``n`` 1)."""

    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop sequence that ended it (the engine's; no chat field carries it)

    def read(self, chunk: dict[str, Any]) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.text += delta["content"]
                events.append(("text", delta["content"]))
            for fragment in delta.get("tool_calls") or ():
                events += self._tool_fragment(fragment)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                events.append(("finish", (self.finish_reason, self.stop_string)))
        return events

    def _tool_fragment(self, fragment: dict[str, Any]) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        index = fragment.get("index", len(self.tool_calls))
        function = fragment.get("function") or {}
        call = next((c for c in self.tool_calls if c.index == index), None)
        if call is None:  # the first fragment of a call carries its id and name, once
            call = ToolCall(index, fragment.get("id") or "", function.get("name") or "")
            self.tool_calls.append(call)
            events.append(("tool_start", call))
        if function.get("arguments"):
            call.arguments += function["arguments"]
            events.append(("tool_args", (call, function["arguments"])))
        return events

    @classmethod
    def of_message(cls, answer: dict[str, Any]) -> ChatReader:
        """A whole chat answer (``ChatRenderer.full``'s object) read the same way."""
        choice = answer["choices"][0]
        message = choice.get("message") or {}
        calls = [ToolCall(i, c.get("id") or "", c["function"]["name"], c["function"].get("arguments") or "")
                 for i, c in enumerate(message.get("tool_calls") or ())]  # fmt: skip
        return cls(message.get("content") or "", calls, choice.get("finish_reason"))


# -- the route's side -------------------------------------------------------------------


class ParsedRequest:
    """What both adapters hold: the vendor's parsed request, its messages in the chat format, and the
    renames of chat parameters into its own (``RENAMES``, for ``rename``)."""

    RENAMES: Sequence[tuple[str, str]] = ()

    def __init__(self, req: Any, messages: list[dict[str, Any]]) -> None:
        self.req = req
        self.messages = messages
        self.stream: bool = req.stream

    def param(self, chat_param: str | None) -> str | None:
        return rename(chat_param, self.RENAMES)


class StreamTranslator(Protocol):
    """One stream's vendor events from the chat path's events; stateful."""

    def opening(self) -> list[bytes]: ...

    def translate(self, kind: str, value: Any) -> list[bytes]: ...

    def closing(self, usage: Usage) -> list[bytes]: ...

    def failed(self, exc: ApiError) -> bytes: ...


class Adapter(Protocol):
    """A vendor API over the chat path: one parsed request, its chat body, its answers."""

    stream: bool

    def chat_body(self) -> dict[str, Any]: ...

    def param(self, chat_param: str | None) -> str | None: ...

    def whole(self, answer: ChatReader, usage: Usage, chat: dict[str, Any]) -> dict[str, Any]: ...

    def streamer(self, chat: dict[str, Any]) -> StreamTranslator: ...

    def error_end(self, exc: ApiError) -> bytes: ...


class AdapterRenderer:
    """The chat route's ``Renderer`` for an adapter: the chat answer made by ``ChatRenderer``, then translated."""

    def __init__(self, plan: Plan, adapter: Adapter) -> None:
        self.chat = ChatRenderer(plan, logprobs=False)
        self.adapter = adapter
        self._stop_string: str | None = None  # a stream's, seen as its last output passes
        # What both vendors' objects repeat (the id's random part, their own prefix before it).
        self._header = {"id": plan.completion_id.split("-", 1)[-1], "created": plan.created, "model": plan.served.name,
                        "prompt_tokens": sum(p.num_tokens for p in plan.prompts)}  # fmt: skip

    def full(self, outputs: dict[int, list[RequestOutput]], usage: Usage) -> dict[str, Any]:
        answer = ChatReader.of_message(self.chat.full(outputs, usage))
        last = outputs[0][-1] if outputs.get(0) else None
        answer.stop_string = last.stop_string if last is not None else None
        return self.adapter.whole(answer, usage, self._header)

    def stream_start(self) -> list[dict[str, Any]]:
        return self.chat.stream_start()

    def stream_event(self, event: ChoiceEvent, include_usage: bool) -> dict[str, Any] | None:
        if event.output.finished:
            self._stop_string = event.output.stop_string
        return self.chat.stream_event(event, include_usage)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self.chat.usage_chunk(usage)

    async def sse_body(self, gen: Generation, first: ChoiceEvent | None, include_usage: bool) -> AsyncIterator[bytes]:
        """The vendor's stream: its opening events, the chat chunks translated, its closing events (the
        last held until the call is on record, as ``[DONE]`` is); an error ends it with the vendor's error event.
        The closing events carry the usage (the chat body never asks for ``include_usage``)."""
        out = self.adapter.streamer(self._header)
        reader = ChatReader()
        for event in out.opening():
            yield event
        try:
            async for chunk in stream_chunks(gen, first, self, False):
                reader.stop_string = self._stop_string
                for kind, value in reader.read(chunk):
                    for event in out.translate(kind, value):
                        yield event
        except GatewayError as exc:
            yield SSELast(out.failed(exc))
            return
        *events, last = out.closing(gen.usage)
        for event in events:
            yield event
        yield SSELast(last)

    def error_end(self, exc: ApiError) -> bytes:
        return self.adapter.error_end(exc)

