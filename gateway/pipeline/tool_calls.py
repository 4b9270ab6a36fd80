"""Tool calling, the output side: the calls in a choice's text, as OpenAI's ``tool_calls`` deltas.

One ``ToolStream`` per choice turns the engine's text into content and call
deltas (``ToolCallDelta``: the call's ``index``, and on its first fragment its
``id`` and function ``name``, then ``arguments`` fragments that concatenate to
the arguments' JSON text). A whole answer is the same deltas put together, so
streamed and whole answers agree.

A forced call (``tool_choice`` required or named) is followed by ``ForcedCalls``,
an ``auto`` answer read by ``AutoCalls`` (``gateway.pipeline.tool_parsers`` says
what each accepts): an ``auto`` call goes out whole once its block ends, a
forced call's arguments in fragments as they are written.

Output guardrails read a call's arguments: every string in them (keys and
values, decoded), each as a text of its own. A block rule blocks the choice as
it would for text (``finish_reason`` ``content_filter``); a redacting rule
redacts inside the strings and the arguments are written again as compact
JSON, so they stay valid JSON. While guardrails read them, a forced call's
arguments go out whole once complete rather than in fragments.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from inferflux.backends.engine import RequestOutput

from inferflux.gateway.pipeline.tool_parsers import AutoCalls, ForcedCalls, compact_json

if TYPE_CHECKING:
    from inferflux.policy.guardrails import Finding, Guardrails

    from inferflux.gateway.pipeline.tools import ToolPlan


def new_call_id() -> str:
    """``call_`` and 24 random hex digits: unique per call, as OpenAI's are."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCallDelta:
    """One fragment of one call (OpenAI's ``delta.tool_calls[]``)."""

    index: int
    id: str | None = None  # first fragment only
    name: str | None = None  # first fragment only
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        out["function"] = function
        return out


@dataclass(frozen=True)
class ToolOutput(RequestOutput):
    """An engine output with its text split: ``new_text`` the content, ``tool_calls`` the call fragments."""

    tool_calls: tuple[ToolCallDelta, ...] = ()


def assemble(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """A whole answer's ``message.tool_calls`` from its fragments."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
        call["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


# -- a choice's stream -----------------------------------------------------------------------------


@dataclass
class ToolStep:
    output: RequestOutput
    findings: list[Finding] = field(default_factory=list)
    blocked: bool = False


class ToolStream:
    """One choice's text split into content and calls, the calls' arguments checked by the output guardrails."""

    def __init__(self, plan: ToolPlan, guards: Guardrails | None = None) -> None:
        self.plan = plan
        self._guards = guards if guards is not None and guards.checks_output else None
        names = frozenset(plan.names)
        self._auto = AutoCalls(names, plan.parallel) if plan.mode == "auto" else None
        self._forced = ForcedCalls() if plan.mode == "forced" else None
        self._ids: list[str] = []
        self._pending: dict[int, list[str]] = {}  # a forced call's arguments, held while guardrails read them
        self.calls: list[tuple[str, str]] = []  # (name, arguments as sent) of each complete call, for the audit
        self._heads: dict[int, str] = {}
        self._blocked = False

    def text(self) -> str:
        """The calls made, as the generic tool prompt writes them (what the audit digests with the content)."""
        return "".join(f'<tool_call>{{"name":"{name}","arguments":{arguments}}}</tool_call>'
                       for name, arguments in self.calls)  # fmt: skip

    def step(self, out: RequestOutput) -> ToolStep:
        deltas: list[ToolCallDelta] = []
        findings: list[Finding] = []
        content = ""
        if self._auto is not None:
            content, found = self._auto.feed(out.new_text)
            if out.finished:
                more, later = self._auto.finish()
                content, found = content + more, found + later
            for name, arguments in found:
                self._whole_call(name, arguments, deltas, findings)
        elif self._forced is not None:
            self._forced_events(self._forced.feed(out.new_text), deltas, findings)
        reason = out.finish_reason
        if out.finished and self._ids and reason == "stop":
            reason = "tool_calls"
        fields_ = {f.name: getattr(out, f.name) for f in fields(RequestOutput)}
        fields_.update(new_text=content, finish_reason=reason)
        return ToolStep(ToolOutput(**fields_, tool_calls=tuple(deltas)), findings, self._blocked)

    def _forced_events(self, events: list[tuple[str, int, str]], deltas: list[ToolCallDelta],
                       findings: list[Finding]) -> None:  # fmt: skip
        streamed = self._guards is None  # else a call goes out whole once the guardrails have read it
        for kind, index, value in events:
            if kind == "head":
                self._heads[index] = value
                self._ids.append(new_call_id())
                self._pending[index] = []
                if streamed:
                    deltas.append(ToolCallDelta(index, self._ids[index], value, ""))
            elif kind == "arguments":
                self._pending[index].append(value)
                if streamed:
                    deltas.append(ToolCallDelta(index, arguments=value))
            else:
                arguments = "".join(self._pending.pop(index))
                if not streamed:
                    arguments = self._checked(arguments, findings)
                    if self._blocked:
                        return
                    deltas.append(ToolCallDelta(index, self._ids[index], self._heads[index], arguments))
                self.calls.append((self._heads[index], arguments))

    def _whole_call(self, name: str, arguments: str, deltas: list[ToolCallDelta], findings: list[Finding]) -> None:
        if self._blocked:
            return
        if self._guards is not None:
            arguments = self._checked(arguments, findings)
            if self._blocked:
                return
        index = len(self._ids)
        self._ids.append(new_call_id())
        deltas.append(ToolCallDelta(index, self._ids[index], name, arguments))
        self.calls.append((name, arguments))

    def _checked(self, arguments: str, findings: list[Finding]) -> str:
        """``arguments`` with every string in them passed through the output guardrails (redacted, or blocked)."""
        guards = self._guards
        if guards is None:
            return arguments
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            value = arguments  # cut short: checked as one text
        changed = False

        def check(text: str) -> str:
            nonlocal changed
            decision = guards.check_output(text)
            findings.extend(decision.findings)
            if not decision.allowed:
                self._blocked = True
            if decision.texts[0] != text:
                changed = True
            return decision.texts[0]

        try:
            checked = _map_strings(value, check)
        except RecursionError:  # deeper than Python recurses: checked as one text, and kept only if clean
            checked = check(arguments)
        if self._blocked or not changed:
            return arguments
        return checked if isinstance(checked, str) else compact_json(checked)


def _map_strings(value: Any, f: Any) -> Any:
    if isinstance(value, str):
        return f(value)
    if isinstance(value, dict):
        return {f(k): _map_strings(v, f) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, f) for v in value]
    return value
