"""The calls in a model's text (``gateway.pipeline.tool_parsers``, ``tool_calls``): parsing, fragments, guardrails.

Auto mode: Hermes ``<tool_call>`` blocks and bare JSON (``arguments`` or ``parameters``,
one call or a list) become calls of the request's tools; anything else (a block that does
not parse, an unknown function, a block left open, plain JSON) stays text. Fed a
character at a time, the parser gives what it gives fed the whole text at once (streamed
and whole answers agree). Forced calls come as a head (id, name) and argument fragments
that concatenate to the arguments' JSON. Output guardrails read the arguments' strings.
"""

from __future__ import annotations

import json

import pytest

from inferflux.backends.engine import RequestOutput
from inferflux.gateway.pipeline.tool_calls import ToolCallDelta, ToolStream, assemble
from inferflux.gateway.pipeline.tool_parsers import AutoCalls, ForcedCalls, parse_calls
from inferflux.gateway.pipeline.tools import ToolPlan
from inferflux.policy.guardrails import Guardrails, parse_spec

NAMES = frozenset({"get_weather", "get_time"})
PARIS = '{"city":"Paris"}'

CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", PARIS)]),
    ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n', "Let me look.",
     [("get_weather", PARIS)]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n<tool_call>{"name": "get_time", '
     '"parameters": {"city": "Rome"}}</tool_call>', None, [("get_weather", PARIS), ("get_time", '{"city":"Rome"}')]),
    ('<tool_call>{"name": "get_time", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>', None,
     [("get_time", PARIS)]),
    ('  {"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", PARIS)]),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]', None,
     [("get_weather", PARIS), ("get_time", "{}")]),
    # Not calls: text as written.
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ('{"name": "delete_everything", "arguments": {}}', '{"name": "delete_everything", "arguments": {}}', []),
    ('[{"name": "get_time", "arguments": {}}, 3]', '[{"name": "get_time", "arguments": {}}, 3]', []),
    ('Sure <tool_call>{"name": "get_time", "arguments": {"city": </tool_call> ok',
     'Sure <tool_call>{"name": "get_time", "arguments": {"city": </tool_call> ok', []),
    ('Sure <tool_call>{"name": "get_time", "arguments": {}', 'Sure <tool_call>{"name": "get_time", "arguments": {}', []),
    ("a < b and <tool or <tool_c", "a < b and <tool or <tool_c", []),
    ("  plain text, trailing space  ", "  plain text, trailing space  ", []),
    ("", "", []),
    # A malformed block stays text beside a good one.
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call> <tool_call>{"name": "get_time", "arguments": {}}'
     '</tool_call>', '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', [("get_time", "{}")]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_auto_mode_parses_hermes_blocks_and_bare_json(text: str, content: str | None, calls: list[tuple[str, str]]
                                                      ) -> None:  # fmt: skip
    assert parse_calls(text, NAMES) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_fed_a_character_at_a_time_the_same(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    parser = AutoCalls(NAMES)
    pieces, found = [], []
    for ch in text:
        piece, more = parser.feed(ch)
        pieces.append(piece)
        found += more
    piece, more = parser.finish()
    joined = "".join(pieces) + piece
    assert ((joined or None) if found + more else joined, found + more) == (content, calls)


def test_tag_text_is_held_back_until_it_cannot_be_a_call() -> None:
    parser = AutoCalls(NAMES)
    assert parser.feed("Hello <tool") == ("Hello", [])
    assert parser.feed("box> there") == (" <toolbox> there", [])


def test_only_the_first_call_without_parallel_calls() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", ' \
           '"arguments": {}}</tool_call>'  # fmt: skip
    assert parse_calls(text, NAMES, parallel=False) == (None, [("get_time", "{}")])


FORCED = '[{"name":"get_weather","arguments":{"city":"Pa\\"]}ris","n":[1,{"a":"}"}]}},{"name":"get_time","arguments":{}}]'


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_forced_calls_come_as_heads_and_argument_fragments(size: int) -> None:
    parser = ForcedCalls()
    events = [e for i in range(0, len(FORCED), size) for e in parser.feed(FORCED[i:i + size])]
    heads = [(i, v) for kind, i, v in events if kind == "head"]
    assert heads == [(0, "get_weather"), (1, "get_time")]
    assert [i for kind, i, _ in events if kind == "end"] == [0, 1]
    arguments = ["".join(v for kind, i, v in events if kind == "arguments" and i == n) for n in (0, 1)]
    assert [json.loads(a) for a in arguments] == [d["arguments"] for d in json.loads(FORCED)]


def _out(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [1], text, finished, "stop" if finished else None, 3, 1)


def _run(stream: ToolStream, text: str, size: int) -> tuple[list[ToolCallDelta], str, str | None, bool]:
    deltas: list[ToolCallDelta] = []
    content, reason, blocked = "", None, False
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for n, piece in enumerate(pieces):
        step = stream.step(_out(piece, n == len(pieces) - 1))
        deltas += step.output.tool_calls  # type: ignore[attr-defined]
        content += step.output.new_text
        reason, blocked = step.output.finish_reason, blocked or step.blocked
    return deltas, content, reason, blocked


def test_a_forced_stream_names_each_call_once_and_ends_with_tool_calls() -> None:
    stream = ToolStream(ToolPlan(tuple(NAMES), "forced", True))
    deltas, content, reason, _ = _run(stream, FORCED, 2)
    assert content == "" and reason == "tool_calls"
    firsts = [d for d in deltas if d.id is not None]
    assert [d.name for d in firsts] == ["get_weather", "get_time"] and all(d.id.startswith("call_") for d in firsts)
    assert all(d.name is None for d in deltas if d.id is None)
    calls = assemble(deltas)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [d["arguments"] for d in json.loads(FORCED)]
    assert [name for name, _ in stream.calls] == ["get_weather", "get_time"]


def _guards(spec: dict[str, object]) -> Guardrails:
    return Guardrails([parse_spec(spec, name="g")])


@pytest.mark.parametrize("mode", ["forced", "auto"])
def test_guardrails_redact_inside_argument_strings_and_keep_json(mode: str) -> None:
    text = '{"name":"get_time","arguments":{"city":"mail bob@example.com","list":["x@y.org",1]}}'
    stream = ToolStream(ToolPlan(tuple(NAMES), mode, False), _guards({"pii": {"email": "redact"}}))  # type: ignore[arg-type]
    deltas, _, reason, blocked = _run(stream, text, 5)
    assert not blocked and reason == "tool_calls"
    [call] = assemble(deltas)
    assert json.loads(call["function"]["arguments"]) == {"city": "mail [EMAIL]", "list": ["[EMAIL]", 1]}


@pytest.mark.parametrize("mode", ["forced", "auto"])
def test_a_blocked_word_in_an_argument_blocks(mode: str) -> None:
    text = '{"name":"get_time","arguments":{"city":"let\'s go ski\\u0069ng"}}'  # escaped: found once decoded
    guards = _guards({"blocklist": [{"id": "ski", "literal": "skiing"}]})
    deltas, _, _, blocked = _run(ToolStream(ToolPlan(tuple(NAMES), mode, False), guards), text, 4)  # type: ignore[arg-type]
    assert blocked and not deltas


@pytest.mark.parametrize("guarded", [False, True])
@pytest.mark.parametrize("mode", ["forced", "auto"])
def test_an_escaped_lone_surrogate_in_generated_arguments_is_read_and_sent_escaped(mode: str, guarded: bool) -> None:
    # A model may write "\\ud800" (valid JSON, no character). The output guardrails read the decoded string
    # (they raised UnicodeEncodeError: a 500, or a broken stream), and the arguments stay sendable as UTF-8.
    text = '{"name":"get_time","arguments":{"city":"\\ud800 bob@example.com"}}'
    guards = _guards({"pii": {"email": "redact"}}) if guarded else None
    stream = ToolStream(ToolPlan(tuple(NAMES), mode, False), guards)  # type: ignore[arg-type]
    deltas, _, reason, blocked = _run(stream, text, 5)
    assert not blocked and reason == "tool_calls"
    [call] = assemble(deltas)
    call["function"]["arguments"].encode("utf-8")
    assert json.loads(call["function"]["arguments"]) == {"city": "\ud800 " + ("[EMAIL]" if guarded else "bob@example.com")}
