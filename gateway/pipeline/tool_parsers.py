"""Tool calling, the output side, its parsers: the calls in a model's text, as it arrives.

``gateway.pipeline.tool_calls`` turns what these find into OpenAI's ``tool_calls``
deltas, one ``ToolStream`` per choice.

* A forced call (``tool_choice`` required or named) was decoded under the call
  schema (``gateway.pipeline.tools.call_schema``): compact JSON, ``{"name":"f",
  "arguments":{...}}`` or an array of those. ``ForcedCalls`` follows it a
  character at a time and reports each call's head once its name is complete,
  then its arguments as they are written.
* ``auto``: ``AutoCalls`` finds Hermes-style ``<tool_call>{...}</tool_call>``
  blocks (the JSON ``{"name", "arguments"}`` or ``{"name", "parameters"}``,
  arguments an object or JSON text of one, of a tool the request defined) and
  an answer that is nothing but such JSON (or a list of it). Text that may
  still become a tag (``<tool`` at the end) is held back, and an answer that
  opens with ``{`` or ``[`` is held whole until it ends: it is a call or it is
  text. A block that does not parse stays in the content as the model wrote
  it; whitespace next to a call is dropped; content is null when only calls
  are left. With ``parallel_tool_calls`` false only the first call is kept.
"""

from __future__ import annotations

import json
import re
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\{"name":"([A-Za-z0-9_-]{1,64})","arguments":')


def call_of(value: Any, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, arguments as compact JSON) of a ``{"name", "arguments"|"parameters"}`` object naming a tool; else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict) or not set(value) <= {"name", "arguments", "parameters"}:
        return None
    return value["name"], compact_json(arguments)


def compact_json(value: Any) -> str:
    """``value`` as compact JSON text that UTF-8 can carry: a lone surrogate the model wrote escaped
    (``"\\ud800"``, valid JSON, but no character) stays escaped rather than failing the answer's encoding."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(value, separators=(",", ":"))
    return text


def calls_of_json(text: str, names: frozenset[str]) -> list[tuple[str, str]] | None:
    """The calls that JSON ``text`` is (one call, or a non-empty list of them), else None."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) and value else [value]
    try:
        calls = [call_of(item, names) for item in items]
    except RecursionError:  # arguments nested deeper than they can be written again: text
        return None
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def parse_calls(text: str, names: frozenset[str], parallel: bool = True) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole auto-mode answer as (content, calls): what ``AutoCalls`` makes of it, at once."""
    parser = AutoCalls(names, parallel)
    content, calls = parser.feed(text)
    more_content, more = parser.finish()
    content += more_content
    calls += more
    return (content or None) if calls else content, calls


class AutoCalls:
    """The calls in freely written text, as it arrives: ``feed`` and ``finish`` give (content, calls)."""

    def __init__(self, names: frozenset[str], parallel: bool = True) -> None:
        self.names, self.parallel = names, parallel
        self._held = ""  # text not released yet
        self._mode = "start"  # start (nothing released) | text | call (inside a block) | json (a bare answer)
        self._calls = 0
        self._after_call = False  # drop whitespace that follows a call
        self._gap = ""  # whitespace before the block being read

    def feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        self._held += text
        content: list[str] = []
        calls: list[tuple[str, str]] = []
        while True:
            if self._mode == "start":
                head = self._held.lstrip()
                if not head:
                    break
                self._mode = "json" if head[0] in "{[" else "text"
            if self._mode == "json":
                break  # a call or text: known at the end
            if self._mode == "text":
                at = self._held.find(OPEN)
                if at < 0:
                    keep = _partial_tag(self._held)
                    content.append(self._release(len(self._held) - keep))
                    break
                released = self._release(at, hold_space=False)
                gap = len(released) - len(released.rstrip())
                content.append(released[:len(released) - gap])
                self._gap = released[len(released) - gap:]  # dropped if a call follows
                self._mode = "call"
            if self._mode == "call":
                end = self._held.find(CLOSE)
                if end < 0:
                    break
                block, self._held = self._held[:end + len(CLOSE)], self._held[end + len(CLOSE):]
                self._mode = "text"
                found = calls_of_json(block[len(OPEN):-len(CLOSE)].strip(), self.names)
                if found is None:
                    content.append(self._gap + block)  # not a call: text, as written
                    self._after_call = False
                else:
                    calls += self._take(found)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[tuple[str, str]]]:
        held, self._held = self._held, ""
        if self._mode == "json":
            found = calls_of_json(held.strip(), self.names)
            if found is not None:
                return "", self._take(found)
        if self._mode == "call":
            held = self._gap + held  # a block left open: text, as written
        if self._after_call:
            held = held.lstrip()
        return (held.rstrip() if self._calls else held), []

    def _release(self, upto: int, hold_space: bool = True) -> str:
        """The text before ``upto``, less whitespace after a call and (``hold_space``) its trailing
        whitespace, which stays held: if a call follows, it is dropped."""
        text, rest = self._held[:upto], self._held[upto:]
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        kept = len(text.rstrip()) if hold_space else len(text)
        self._held = text[kept:] + rest
        return text[:kept]

    def _take(self, found: list[tuple[str, str]]) -> list[tuple[str, str]]:
        if not self.parallel:
            found = found[: max(0, 1 - self._calls)]
        self._calls += len(found)
        self._after_call = True
        return found


def _partial_tag(text: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class ForcedCalls:
    """A forced answer's calls as it is written: heads once their name is complete, then argument fragments."""

    def __init__(self) -> None:
        self._text = ""  # the answer so far
        self._pos = 0  # where reading goes on
        self._state = "between"  # between | head | arguments
        self._call_start = 0
        self._depth = 0
        self._in_string = self._escaped = False
        self.index = -1  # the call being written

    def feed(self, text: str) -> list[tuple[str, int, str]]:
        """Events (kind, call index, text): ("head", i, name), ("arguments", i, fragment), and ("end", i, "")
        once call i's arguments are complete."""
        self._text += text
        events: list[tuple[str, int, str]] = []
        while self._pos < len(self._text):
            if self._state == "between":
                at = self._text.find("{", self._pos)
                if at < 0:
                    self._pos = len(self._text)
                    break
                self._state, self._call_start, self._pos = "head", at, at
            if self._state == "head":
                match = _HEAD.match(self._text, self._call_start)
                if match is None:
                    break  # the name is still being written
                self.index += 1
                events.append(("head", self.index, match.group(1)))
                self._state, self._pos, self._depth = "arguments", match.end(), 0
            if self._state == "arguments":
                start = self._pos
                done = self._scan()
                if self._pos > start:
                    events.append(("arguments", self.index, self._text[start:self._pos]))
                if not done:
                    break
                events.append(("end", self.index, ""))
                self._state = "between"
        return events

    def _scan(self) -> bool:
        """Read the arguments' JSON on; True once it is complete."""
        text = self._text
        while self._pos < len(text):
            c = text[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return True
        return False
