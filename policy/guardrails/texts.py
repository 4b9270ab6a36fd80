"""The texts a guardrail checks in an OpenAI-shaped request body, and putting redacted ones back.

Every string of the body that reaches the model is a text, in this order:

1. chat messages' ``content`` (a string, or each ``text`` part of a list);
2. completions' ``prompt`` and embeddings' ``input`` (a string or a list of
   strings); token-id prompts and inputs too, decoded, when the caller gives a
   ``decode`` (``collect``);
3. for each message, its ``name`` and ``tool_call_id``, then its calls
   (``messages[i].tool_calls[j]``): the call's ``id`` and function ``name``, and
   every key and value of its ``arguments`` (JSON text;
   a number as its digits, so that a card number written as a JSON number is
   read by the card rule; arguments that are not JSON count as one text);
4. each tool's ``name``, ``description``, and every key and value of its
   ``parameters`` schema (property names, ``$defs`` keys, ``enum`` values,
   ``pattern``, ``required`` entries, ``$ref``, descriptions, numbers), but
   JSON Schema's own keywords as keys and its type names as ``type``'s value:
   the schema's syntax, the same in every tool.

A ``tool`` message's result is its ``content``, as any message's.

Some texts cannot be rewritten without changing what the request means: a
name, an id, a key, a schema's machinery (``type``, ``$ref``, ``format``,
``pattern``, ``required``, ...) and decoded token ids. They are ``fixed``: a
redacting rule that matches one refuses the request instead (``screen``).
Redacted values are written back where they were (a number as the redacted
string), so call arguments stay JSON and schemas stay schemas.

``groups`` name the texts the model reads as one, beyond each text alone: a
message's content parts (joined with nothing between them), and the last string
of a call's arguments with the result that answers the call; a word split across
a group is found (``check.check_texts``).

A string holding a lone UTF-16 surrogate (``"\\ud800"``), which no encoding
holds, cannot come from the body's JSON (``gateway.pipeline.body`` refuses it) but can
from the JSON text inside a call's ``arguments``: that is a 400 naming the
arguments (``InvalidText``), for every tenant, before anything tries to encode it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferflux.policy.guardrails.errors import InvalidText

Slot = tuple[Any, ...]
# The fields whose value is a string or a list of strings (or token ids), each a text.
_TEXT_FIELDS = ("prompt", "input")
# Schema keywords whose string values are the schema's machinery: read, never rewritten.
_SCHEMA_WORDS = frozenset({"type", "$ref", "$schema", "$id", "$anchor", "$dynamicRef", "$dynamicAnchor", "format",
                           "pattern", "required", "contentEncoding", "contentMediaType"})  # fmt: skip
# JSON Schema's keywords (2020-12 and draft 7) and type names: as a key, or as ``type``'s value, they are the
# schema's syntax, not read (a property of that name is the same word, so nothing is missed).
_KEYWORDS = frozenset({
    "$schema", "$id", "$ref", "$defs", "$anchor", "$dynamicRef", "$dynamicAnchor", "$vocabulary", "$comment",
    "definitions", "type", "enum", "const", "properties", "patternProperties", "additionalProperties",
    "propertyNames", "required", "dependentRequired", "dependentSchemas", "dependencies", "items", "prefixItems",
    "additionalItems", "unevaluatedItems", "unevaluatedProperties", "contains", "minContains", "maxContains",
    "minItems", "maxItems", "uniqueItems", "minProperties", "maxProperties", "minLength", "maxLength", "pattern",
    "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "allOf", "anyOf",
    "oneOf", "not", "if", "then", "else", "title", "description", "default", "examples", "deprecated",
    "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "contentSchema", "nullable", "strict",
})  # fmt: skip
_TYPE_NAMES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
# Card numbers have 13 to 19 digits: a JSON number that long is read as text (others are not prose).
_NUMBER_DIGITS = range(13, 20)

# What decodes token ids to text: the model's tokenizer (None: it cannot; the caller refuses).
Decode = Callable[[Sequence[int]], str | None]


@dataclass
class RequestTexts:
    """A body's texts, where each came from (``slots``), which cannot be rewritten, and which read as one."""

    slots: list[Slot] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    fixed: set[int] = field(default_factory=set)
    groups: list[tuple[int, ...]] = field(default_factory=list)
    # call id -> (the index of the call's last text) while collecting, for the call -> result groups
    _last_of_call: dict[str, int] = field(default_factory=dict, repr=False)

    def add(self, slot: Slot, text: str, *, fixed: bool = False) -> int:
        self.slots.append(slot)
        self.texts.append(text)
        if fixed:
            self.fixed.add(len(self.texts) - 1)
        return len(self.texts) - 1


def collect(body: Mapping[str, Any], decode: Decode | None = None) -> RequestTexts:
    """The texts of a chat, completion or embeddings request body, in a stable order (see the module's docstring).

    ``decode``: token-id prompts and inputs are decoded with it and checked as fixed texts; without it
    they are left out. Raises ``InvalidText`` for a call's arguments holding a lone surrogate."""
    out = RequestTexts()
    messages = body.get("messages")
    messages = messages if isinstance(messages, list) else []
    for i, message in enumerate(messages):
        if isinstance(message, Mapping):
            _message(out, i, message)
    for name in _TEXT_FIELDS:
        _prompts(out, name, body.get(name), decode)
    for i, message in enumerate(messages):
        for name in ("name", "tool_call_id"):
            if isinstance(message, Mapping) and isinstance(message.get(name), str):
                out.add(("messages", i, name), message[name], fixed=True)
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        for j, call in enumerate(calls if isinstance(calls, list) else ()):
            if isinstance(call, Mapping):
                _call(out, i, j, call)
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping):
            _tool(out, i, function)
    _result_groups(out, messages)
    return out


def _message(out: RequestTexts, i: int, message: Mapping[str, Any]) -> None:
    content = message.get("content")
    if isinstance(content, str):
        out.add(("messages", i), content)
    elif isinstance(content, list):
        parts = [out.add(("messages", i, "content", j), part["text"]) for j, part in enumerate(content)
                 if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)]  # fmt: skip
        if len(parts) > 1:
            out.groups.append(tuple(parts))  # the model reads the parts joined with nothing between them


def _prompts(out: RequestTexts, name: str, value: Any, decode: Decode | None) -> None:
    if isinstance(value, str):
        out.add((name,), value)
    elif isinstance(value, list):
        if value and all(_is_int(t) for t in value):  # one token-id prompt
            _tokens(out, name, None, value, decode)
            return
        for i, item in enumerate(value):
            if isinstance(item, str):
                out.add((name, i), item)
            elif isinstance(item, list) and item and all(_is_int(t) for t in item):
                _tokens(out, name, i, item, decode)


def _tokens(out: RequestTexts, name: str, i: int | None, ids: list[int], decode: Decode | None) -> None:
    if decode is None:
        return
    try:
        text = decode(ids)
    except InvalidText as exc:  # they cannot be read here at all: the error names where they are
        exc.param = name if i is None else f"{name}[{i}]"
        raise
    if text is None:  # ids the tokenizer does not know: the model refuses them later, nothing to read here
        return
    out.add(("tokens", name, i), text, fixed=True)


def _call(out: RequestTexts, i: int, j: int, call: Mapping[str, Any]) -> None:
    if isinstance(call.get("id"), str):
        out.add(("calls", i, j, "id"), call["id"], fixed=True)
    function = call.get("function")
    if not isinstance(function, Mapping):
        return
    if isinstance(function.get("name"), str):
        out.add(("calls", i, j, "name"), function["name"], fixed=True)
    arguments = function.get("arguments")
    last = None
    if isinstance(arguments, str):
        parsed = _json(arguments)
        if isinstance(parsed, dict | list):
            param = f"messages[{i}].tool_calls[{j}].function.arguments"
            for path, text, kind in _strings(parsed):
                _refuse_unencodable(text, param)
                last = out.add(("calls", i, j, kind, *path), text, fixed=kind == "key")
        else:
            last = out.add(("calls", i, j, "arguments"), arguments)
    if last is not None and isinstance(call.get("id"), str):
        out._last_of_call[call["id"]] = last


def _tool(out: RequestTexts, i: int, function: Mapping[str, Any]) -> None:
    if isinstance(function.get("name"), str):
        out.add(("tools", i, "name"), function["name"], fixed=True)
    if isinstance(function.get("description"), str):
        out.add(("tools", i, "description"), function["description"])
    parameters = function.get("parameters")
    if isinstance(parameters, dict | list):
        for path, text, kind in _strings(parameters):
            under = next((k for k in reversed(path) if isinstance(k, str)), None)
            if (kind == "key" and text in _KEYWORDS) or (under == "type" and text in _TYPE_NAMES):
                continue  # the schema's own syntax, the same in every tool: nothing a tenant wrote
            out.add(("tools", i, kind, *path), text, fixed=kind == "key" or under in _SCHEMA_WORDS)


def _result_groups(out: RequestTexts, messages: list[Any]) -> None:
    """A call's last text and the result that answers it, read as one (a word split between the two)."""
    by_slot = {slot: k for k, slot in enumerate(out.slots)}
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") != "tool":
            continue
        call_id = message.get("tool_call_id")
        last = out._last_of_call.get(call_id) if isinstance(call_id, str) else None
        content = message.get("content")
        parts = [by_slot[("messages", i)]] if ("messages", i) in by_slot else [
            by_slot[("messages", i, "content", j)] for j in range(len(content) if isinstance(content, list) else 0)
            if ("messages", i, "content", j) in by_slot]  # fmt: skip
        if last is not None and parts:
            out.groups.append((last, *parts))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse_unencodable(text: str, param: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidText(f"{param} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not a character",
                          param=param, code="invalid_unicode") from None  # fmt: skip


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _strings(value: Any) -> list[tuple[tuple[Any, ...], str, str]]:
    """Every key, string and long integer in a JSON value: (path, text, "key" | "value"), in document order
    (iteratively: a body's nesting is bounded, the JSON text inside one of its strings is not). A key's path
    is its object's path and the key."""
    out: list[tuple[tuple[Any, ...], str, str]] = []
    stack: list[tuple[tuple[Any, ...], Any, bool]] = [((), value, False)]
    while stack:
        path, item, is_key = stack.pop()
        if is_key:
            out.append((path, item, "key"))
        elif isinstance(item, str):
            out.append((path, item, "value"))
        elif isinstance(item, dict):
            for k, v in reversed(item.items()):
                stack.append(((*path, k), v, False))
                stack.append(((*path, k), k, True))
        elif isinstance(item, list):
            stack.extend(((*path, n), v, False) for n, v in reversed(list(enumerate(item))))
        elif (number := _long_number(item)) is not None:
            out.append((path, number, "value"))
    return out


def _long_number(item: Any) -> str | None:
    """The digits of a JSON number that could be a card number (13-19 digits, integral), else None."""
    if isinstance(item, bool) or not isinstance(item, int | float):
        return None
    if isinstance(item, float) and not (item.is_integer() and abs(item) < 1e19):
        return None
    digits = str(abs(int(item)))
    return digits if len(digits) in _NUMBER_DIGITS else None


def request_texts(body: Mapping[str, Any]) -> list[str]:
    """The texts of a chat, completion or embeddings request body, in a stable order (``collect``'s)."""
    return collect(body).texts


def with_texts(body: Mapping[str, Any], texts: Sequence[str], collected: RequestTexts | None = None) -> dict[str, Any]:
    """A copy of ``body`` with its texts (as ``collect`` lists them) replaced by ``texts``; a text equal to
    the one it replaces is left where it was (a number stays a number). A fixed text must not change."""
    collected = collect(body) if collected is None else collected
    if len(collected.texts) != len(texts):
        raise ValueError(f"expected {len(collected.texts)} texts, got {len(texts)}")
    changed = [(slot, text) for k, (slot, before, text) in enumerate(zip(collected.slots, collected.texts, texts,
               strict=True)) if text != before and _writable(slot, k, collected)]  # fmt: skip
    # Copy only the containers on the way to a text (the body is JSON: dicts, lists
    # and scalars; a deep copy cost more than the checks); ``body`` stays as it was.
    out = dict(body)
    for name in _TEXT_FIELDS:
        if isinstance(out.get(name), list):
            out[name] = list(out[name])
    if isinstance(out.get("messages"), list):
        out["messages"] = [_copied_message(m) for m in out["messages"]]
    if any(slot[0] == "tools" for slot, _ in changed):
        out["tools"] = copy.deepcopy(out["tools"])  # rare (a rule redacted a tool's schema): copied whole
    arguments: dict[tuple[int, int], Any] = {}  # history calls' arguments, parsed, while values are put back
    for slot, text in changed:
        _put_text(out, slot, text, arguments)
    for (i, j), value in arguments.items():
        out["messages"][i]["tool_calls"][j]["function"]["arguments"] = json.dumps(value, ensure_ascii=False)
    return out


def _writable(slot: Slot, index: int, collected: RequestTexts) -> bool:
    if index in collected.fixed:
        raise ValueError(f"the text at {slot} cannot be rewritten")  # ``screen`` refuses instead: a bug if here
    return True


def _put_text(out: dict[str, Any], slot: Slot, text: str, arguments: dict[tuple[int, int], Any]) -> None:
    if slot[0] == "calls":
        i, j = slot[1], slot[2]
        call = out["messages"][i]["tool_calls"][j]
        if slot[3] == "arguments" and len(slot) == 4:  # arguments that are not JSON: one text
            call["function"]["arguments"] = text
            return
        if (i, j) not in arguments:
            arguments[(i, j)] = _json(call["function"]["arguments"])
        _put(arguments[(i, j)], slot[4:], text)
    elif slot[0] == "tools":
        function = out["tools"][slot[1]]["function"]
        if slot[2] == "description":
            function["description"] = text
        else:
            _put(function["parameters"], slot[3:], text)
    elif slot[0] in _TEXT_FIELDS:
        if len(slot) == 1:
            out[slot[0]] = text
        else:
            out[slot[0]][slot[1]] = text
    elif len(slot) == 2:
        out["messages"][slot[1]]["content"] = text
    else:
        out["messages"][slot[1]]["content"][slot[3]]["text"] = text


def _put(container: Any, path: tuple[Any, ...], text: str) -> None:
    for step in path[:-1]:
        container = container[step]
    container[path[-1]] = text


def _copied_message(message: Any) -> Any:
    if not isinstance(message, Mapping):
        return message
    copied = dict(message)
    if isinstance(copied.get("content"), list):
        copied["content"] = [dict(part) if isinstance(part, Mapping) else part for part in copied["content"]]
    if isinstance(copied.get("tool_calls"), list):
        copied["tool_calls"] = [{**c, "function": dict(c["function"])} if isinstance(c, Mapping) and
                                isinstance(c.get("function"), Mapping) else c for c in copied["tool_calls"]]  # fmt: skip
    return copied
