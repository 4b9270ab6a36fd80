"""Tool definitions and tool-call history in a chat prompt: through the model's template, or a generic prompt.

A template that reads the ``tools`` variable (Qwen2.5, Qwen3, Llama 3.x,
Hermes-style templates) is given what transformers' ``apply_chat_template``
gives it: ``tools`` as a list of OpenAI-shaped ``{"type": "function",
"function": {...}}`` objects, assistant ``tool_calls`` with their ``arguments``
as objects (dicts, as those templates ``tojson`` them), and ``tool`` messages
as they are. Whether a template reads ``tools`` is found from its syntax tree,
not guessed from its text.

A template that does not (SmolLM2's, ChatML) gets the generic tool prompt:
``GENERIC_TOOL_PROMPT`` with the tools' JSON added to the system message (or
as a system message of its own, first), which asks for Hermes-style
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; earlier
calls are written into their assistant message as those blocks, and a run of
``tool`` messages becomes one ``user`` message of ``<tool_response>`` blocks
(the form Qwen2.5's own template writes). So only the roles every template
knows reach it. docs/api.md quotes the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from inferflux.backends.models.chat_template import template_variables
from inferflux.backends.models.errors import ChatTemplateError

__all__ = ["GENERIC_TOOL_PROMPT", "generic_tool_messages", "tool_call_text", "template_uses_tools"]

GENERIC_TOOL_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


@lru_cache(maxsize=32)
def template_uses_tools(source: str) -> bool:
    """Whether a chat template reads the ``tools`` variable (then it renders tool definitions itself)."""
    try:
        return "tools" in template_variables(source)
    except ChatTemplateError:
        return False  # rendering names the template's error


def tool_call_text(name: str, arguments: Any) -> str:
    """One call as the generic prompt asks for it (``arguments`` an object)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def generic_tool_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
                          ) -> list[dict[str, Any]]:  # fmt: skip
    """``messages`` (template-shaped: assistant ``tool_calls`` with object arguments, ``tool`` messages)
    rewritten into system, user and assistant messages of text, with ``tools`` described in the system prompt."""
    out: list[dict[str, Any]] = []
    responses: list[str] = []

    def close_responses() -> None:
        if responses:
            out.append({"role": "user", "content": "\n".join(responses)})
            responses.clear()

    for message in messages:
        role = message.get("role")
        if role == "tool":
            responses.append(f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>")
            continue
        close_responses()
        rendered = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        rendered["content"] = _text(message.get("content"))
        calls = message.get("tool_calls") or ()
        if calls:
            written = [tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            rendered["content"] = "\n".join(([rendered["content"]] if rendered["content"] else []) + written)
        out.append(rendered)
    close_responses()
    if tools:
        section = GENERIC_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{first}\n\n{section}" if first else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _text(content: Any) -> str:
    return "" if content is None else str(content)
