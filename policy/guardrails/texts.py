"""The texts a guardrail checks in an OpenAI-shaped request body, and putting redacted ones back.

Chat messages' ``content`` (a string, or a list of parts whose ``text`` parts
count), completions' ``prompt`` and embeddings' ``input`` (each a string or a
list of strings) are checked, in that order; then what tool calling adds to a
chat: every string value in the arguments of the history's calls
(``messages[i].tool_calls[j].function.arguments``, JSON text: a redacted value
is written back into it, so the arguments stay JSON; text that is not JSON
counts as one text), and each tool's ``description`` and the string values of
its ``parameters`` schema (descriptions, enums, ...; not its ``type``,
``$ref``, ``format``, ``pattern`` or ``required`` names). A ``tool`` message's
result is its ``content``, checked as any message's. Nothing else in the body
is. Token-id prompts and inputs are not text and are left alone.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

# A place in the body: ("messages", i) / ("messages", i, "content", j) / ("prompt",) / ("prompt", i) / ("input",) / ...
# The fields whose value is a string or a list of strings, each a text.
_TEXT_FIELDS = ("prompt", "input")
Slot = tuple[Any, ...]


def _slots(body: Mapping[str, Any]) -> list[tuple[Slot, str]]:
    out: list[tuple[Slot, str]] = []
    messages = body.get("messages")
    if isinstance(messages, Sequence) and not isinstance(messages, str):
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                out.append((("messages", i), content))
            elif isinstance(content, Sequence):
                for j, part in enumerate(content):
                    if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                        out.append((("messages", i, "content", j), part["text"]))
    for name in _TEXT_FIELDS:
        value = body.get(name)
        if isinstance(value, str):
            out.append(((name,), value))
        elif isinstance(value, Sequence):
            out.extend(((name, i), v) for i, v in enumerate(value) if isinstance(v, str))
    out += _tool_slots(body)
    return out


def _tool_slots(body: Mapping[str, Any]) -> list[tuple[Slot, str]]:
    """("calls", i, j, *path) for a string in a history call's arguments (no path: the arguments, not JSON);
    ("tools", i, "description") and ("tools", i, "parameters", *path) for a tool's."""
    out: list[tuple[Slot, str]] = []
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            calls = message.get("tool_calls") if isinstance(message, Mapping) else None
            for j, call in enumerate(calls if isinstance(calls, list) else ()):
                function = call.get("function") if isinstance(call, Mapping) else None
                arguments = function.get("arguments") if isinstance(function, Mapping) else None
                if isinstance(arguments, str):
                    parsed = _json(arguments)
                    if isinstance(parsed, dict | list):
                        out += [(("calls", i, j, *path), text) for path, text in _strings(parsed)]
                    else:
                        out.append((("calls", i, j), arguments))
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping):
            continue
        if isinstance(function.get("description"), str):
            out.append((("tools", i, "description"), function["description"]))
        if isinstance(function.get("parameters"), dict | list):
            out += [(("tools", i, "parameters", *path), text) for path, text in _strings(function["parameters"])
                    if next((k for k in reversed(path) if isinstance(k, str)), None) not in _SCHEMA_WORDS]  # fmt: skip
    return out


# Schema keywords whose strings are the schema's machinery, not text the model reads as prose (redacting
# one would break the schema): checked neither way.
_SCHEMA_WORDS = frozenset({"type", "$ref", "$schema", "$id", "format", "pattern", "required"})


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _strings(value: Any) -> list[tuple[tuple[Any, ...], str]]:
    """Every string value in a JSON value, with its path (iteratively: a body's nesting is bounded, the JSON
    text inside one of its strings is not)."""
    out: list[tuple[tuple[Any, ...], str]] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            out.append((path, item))
        elif isinstance(item, dict):
            stack.extend(((*path, k), v) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend(((*path, n), v) for n, v in reversed(list(enumerate(item))))
    return out


def _put(container: Any, path: tuple[Any, ...], text: str) -> None:
    for step in path[:-1]:
        container = container[step]
    container[path[-1]] = text


def request_texts(body: Mapping[str, Any]) -> list[str]:
    """The texts of a chat, completion or embeddings request body, in a stable order."""
    return [text for _, text in _slots(body)]


def with_texts(body: Mapping[str, Any], texts: Sequence[str]) -> dict[str, Any]:
    """A copy of ``body`` with its texts (as ``request_texts`` lists them) replaced by ``texts``."""
    slots = _slots(body)
    if len(slots) != len(texts):
        raise ValueError(f"expected {len(slots)} texts, got {len(texts)}")
    # Copy only the containers on the way to a text (the body is JSON: dicts, lists
    # and scalars; a deep copy cost more than the checks); ``body`` stays as it was.
    out = dict(body)
    for name in _TEXT_FIELDS:
        if isinstance(out.get(name), list):
            out[name] = list(out[name])
    if isinstance(out.get("messages"), list):
        out["messages"] = [_copied_message(m) for m in out["messages"]]
    if any(slot[0] == "tools" for slot, _ in slots):
        out["tools"] = copy.deepcopy(out["tools"])  # rare (a rule redacted a tool's schema): copied whole
    arguments: dict[tuple[int, int], Any] = {}  # history calls' arguments, parsed, while values are put back
    for (slot, _), text in zip(slots, texts, strict=True):
        if slot[0] == "calls":
            i, j = slot[1], slot[2]
            call = out["messages"][i]["tool_calls"][j]
            if len(slot) == 3:
                call["function"]["arguments"] = text
                continue
            if (i, j) not in arguments:
                arguments[(i, j)] = _json(call["function"]["arguments"])
            _put(arguments[(i, j)], slot[3:], text)
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
    for (i, j), value in arguments.items():
        out["messages"][i]["tool_calls"][j]["function"]["arguments"] = json.dumps(value, ensure_ascii=False)
    return out


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
