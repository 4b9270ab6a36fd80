"""The texts a guardrail checks in an OpenAI-shaped request body, and putting redacted ones back.

Chat messages' ``content`` (a string, or a list of parts whose ``text`` parts
count), completions' ``prompt`` and embeddings' ``input`` (each a string or a
list of strings) are checked, in that order; nothing else in the body is.
Token-id prompts and inputs are not text and are left alone.
"""

from __future__ import annotations

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
    return out


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
    for (slot, _), text in zip(slots, texts, strict=True):
        if slot[0] in _TEXT_FIELDS:
            if len(slot) == 1:
                out[slot[0]] = text
            else:
                out[slot[0]][slot[1]] = text
        elif len(slot) == 2:
            out["messages"][slot[1]]["content"] = text
        else:
            out["messages"][slot[1]]["content"][slot[3]]["text"] = text
    return out


def _copied_message(message: Any) -> Any:
    if not isinstance(message, Mapping):
        return message
    copied = dict(message)
    if isinstance(copied.get("content"), list):
        copied["content"] = [dict(part) if isinstance(part, Mapping) else part for part in copied["content"]]
    return copied
