"""``POST /v1/responses``: OpenAI's Responses API, its stateless subset, as an adapter over the chat path.

The request becomes a chat-completions body (``ResponsesAdapter.chat_body``):
``instructions`` a first system message; ``input`` a string (one user message)
or items: ``message`` items (roles user, system, developer, assistant; content a
string or ``input_text``/``output_text``/``refusal`` parts), ``function_call``
items (consecutive ones one assistant message with several ``tool_calls``) and
``function_call_output`` items (``tool`` messages); ``max_output_tokens`` is
``max_completion_tokens``, ``text.format`` is ``response_format``, function
``tools`` are chat tools, ``tool_choice``/``parallel_tool_calls``/``temperature``/
``top_p`` as they are, ``user`` (or ``safety_identifier``) is ``user``.

Stateless: nothing is stored, so ``store`` is accepted but every response
says ``"store": false`` (it cannot be retrieved or continued), and what needs a
stored response or a server-side conversation is refused with
``unsupported_parameter`` naming it: ``previous_response_id``, ``conversation``,
``background``, ``prompt`` (stored prompt templates), ``include``,
``truncation: auto``, ``reasoning`` with an effort (no reasoning model here),
``max_tool_calls``, ``top_logprobs``; so are hosted tools (web search, file
search, ...) and image, file and audio inputs.

The answer: a ``message`` output item with one ``output_text`` part and a
``function_call`` item per tool call; ``status`` ``completed``, or
``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens`` (the
chat path's ``length``) or ``content_filter``; ``usage`` in input/output
tokens. Streams send the typed events, each with its ``sequence_number``:
``response.created``, ``response.in_progress``, per item
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``/``.done``, ``response.content_part.done`` (or
``response.function_call_arguments.delta``/``.done``),
``response.output_item.done``, then ``response.completed`` (or
``response.incomplete``); an error after the first event is an ``error`` event
and ``response.failed``.
"""

from __future__ import annotations

from typing import Any

from inferflux.gateway.pipeline.adapters.common import BodyError, ChatReader, ParsedRequest, ToolCall, named_event, parse_body
from inferflux.gateway.pipeline.adapters.responses_request import ResponsesRequest, chat_messages
from inferflux.gateway.pipeline.generation import Usage
from inferflux.policy.errors import ApiError

# A chat parameter named by an error past the translation, as this API spells it.
_RENAMES = (
    (r"^messages.*", "input"),  # the items are not the messages one for one: the whole input is named
    (r"^(max_completion_tokens|max_tokens)$", "max_output_tokens"),
    (r"^response_format(\.json_schema)?", "text.format"),
    (r"^tools\[(\d+)\]\.function", r"tools[\1]"),
)


def parse_responses(body: dict[str, Any]) -> ResponsesAdapter:
    req = parse_body(ResponsesRequest, body)
    try:
        req.refusals()
        messages = chat_messages(req)
    except BodyError as exc:  # raised past pydantic's validation: the same answer
        raise exc.to_gateway() from None
    return ResponsesAdapter(req, messages)


class ResponsesAdapter(ParsedRequest):
    """One parsed Responses request: its chat body, and its answers in the Responses API's shape."""

    RENAMES = _RENAMES
    req: ResponsesRequest
    _out: ResponseStream | None = None  # the stream's translator, once it started

    def chat_body(self) -> dict[str, Any]:
        req = self.req
        body: dict[str, Any] = {"model": req.model, "messages": self.messages, "stream": req.stream}
        optional = {
            "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls,
            "user": req.user if req.user is not None else req.safety_identifier,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        if req.tools:
            body["tools"] = [_chat_tool(t) for t in req.tools]
        if isinstance(req.tool_choice, dict):
            body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice["name"]}}
        elif req.tool_choice is not None:
            body["tool_choice"] = req.tool_choice
        if req.text is not None and req.text.format is not None:
            body["response_format"] = req.text.format.response_format()
        return body

    # -- the answer

    def response(self, header: dict[str, Any], status: str, output: list[dict[str, Any]],
                 usage: Usage | None, reason: str | None = None) -> dict[str, Any]:  # fmt: skip
        """The response object (``status`` in_progress, completed, incomplete or failed)."""
        req = self.req
        text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
            else {"type": "text"}  # fmt: skip
        return {
            "id": f"resp_{header['id']}",
            "object": "response",
            "created_at": header["created"],
            "status": status,
            "error": None,
            "incomplete_details": {"reason": reason} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": header["model"],
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,  # stateless: never stored, whatever was asked
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": text_format},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": None if usage is None else _usage(usage),
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def whole(self, answer: ChatReader, usage: Usage, header: dict[str, Any]) -> dict[str, Any]:
        status, reason = _status(answer.finish_reason)
        item_status = "completed" if status == "completed" else "incomplete"
        output = [_message_item(header, answer.text, item_status)] if answer.text or not answer.tool_calls else []
        output += [_call_item(header, call, "completed") for call in answer.tool_calls]
        return self.response(header, status, output, usage, reason)

    def streamer(self, header: dict[str, Any]) -> ResponseStream:
        self._out = ResponseStream(self, header)
        return self._out

    def error_end(self, exc: ApiError) -> bytes:
        return (self._out or ResponseStream(self, {})).failed(exc)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "content_filter":
        return "incomplete", "content_filter"
    return "completed", None


def _usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}  # fmt: skip


def _message_item(header: dict[str, Any], text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": f"msg_{header['id']}", "type": "message", "status": status, "role": "assistant", "content": content}


def _call_item(header: dict[str, Any], call: ToolCall, status: str) -> dict[str, Any]:
    return {"id": f"fc_{header['id']}_{call.index}", "type": "function_call", "status": status,
            "call_id": call.id, "name": call.name, "arguments": call.arguments}  # fmt: skip


class ResponseStream:
    """One stream's Responses events from the chat path's events (``ChatReader``): an item opens on its
    first text or call, and closes when the next opens or the generation ends."""

    def __init__(self, adapter: ResponsesAdapter, header: dict[str, Any]) -> None:
        self.adapter = adapter
        self.header = header
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the output so far, each item as last sent
        self.open: dict[str, Any] | None = None  # the item still receiving text or arguments
        self.calls: dict[int, dict[str, Any]] = {}  # a tool call's index -> its item
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return named_event(kind, payload)

    def opening(self) -> list[bytes]:
        started = self.adapter.response(self.header, "in_progress", [], None)
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]  # fmt: skip

    def translate(self, kind: str, value: Any) -> list[bytes]:
        if kind == "text":
            events = [] if self.open is not None and self.open["type"] == "message" else self._open_message()
            self.open["content"][0]["text"] += value  # type: ignore[index]
            return events + [self._event("response.output_text.delta", item_id=self.open["id"],  # type: ignore[index]
                                         output_index=len(self.items) - 1, content_index=0, delta=value,
                                         logprobs=[])]  # fmt: skip
        if kind == "tool_start":
            events = self._close()
            self.open = self.calls[value.index] = _call_item(self.header, value, "in_progress")
            self.open["arguments"] = ""  # what its deltas add up to (the reader has read the first already)
            self.items.append(self.open)
            return events + [self._event("response.output_item.added", output_index=len(self.items) - 1,
                                         item=self.open)]  # fmt: skip
        if kind == "tool_args":
            call, fragment = value
            item = self.calls[call.index]
            item["arguments"] += fragment
            return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=self.items.index(item), delta=fragment)]  # fmt: skip
        self.finish_reason, _ = value
        return []

    def _open_message(self) -> list[bytes]:
        events = self._close()
        self.open = _message_item(self.header, None, "in_progress")
        self.items.append(self.open)
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index,
                                  item=self.open))  # fmt: skip
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.open["content"] = [part]
        events.append(self._event("response.content_part.added", item_id=self.open["id"], output_index=index,
                                  content_index=0, part=part))  # fmt: skip
        return events

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        status, _ = _status(self.finish_reason)
        item["status"] = "completed" if status == "completed" else "incomplete"
        if item["type"] == "message":
            part = item["content"][0]
            return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                                part=part),
                    self._event("response.output_item.done", output_index=index, item=item)]  # fmt: skip
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]  # fmt: skip

    def closing(self, usage: Usage) -> list[bytes]:
        events = [] if self.items else self._open_message()  # an empty answer is still one (empty) message
        events += self._close()
        status, reason = _status(self.finish_reason)
        final = self.adapter.response(self.header, status, self.items, usage, reason)
        return events + [self._event(f"response.{status}", response=final)]

    def failed(self, exc: ApiError) -> bytes:
        """The ``error`` event, then ``response.failed`` (when the stream had begun)."""
        error = self._event("error", code=exc.code, message=exc.message, param=exc.param)
        if not self.header:
            return error
        failed = self.adapter.response(self.header, "failed", self.items, None)
        failed["error"] = {"code": exc.code or exc.error_type, "message": exc.message}
        return error + self._event("response.failed", response=failed)
