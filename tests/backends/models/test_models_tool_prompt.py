"""Tools in the chat prompt (``backends.models.tool_prompt``, ``gateway.pipeline.tools.render_chat``).

A template that reads ``tools`` (here a tiny Hermes-style one, written the way Qwen2.5's
is) gets them as transformers passes them, and the history's calls with their arguments
as objects; one that does not (ChatML, SmolLM2's) gets the generic tool prompt in its
system message, earlier calls as ``<tool_call>`` blocks and results as a user message of
``<tool_response>`` blocks, so only roles it knows reach it.
"""

from __future__ import annotations

import json

from inferflux.backends.models.chat_template import CHATML_TEMPLATE, ChatTemplate
from inferflux.backends.models.tool_prompt import GENERIC_TOOL_PROMPT, generic_tool_messages, template_uses_tools
from inferflux.gateway.pipeline.protocol import ChatCompletionRequest, parse_request
from inferflux.gateway.pipeline.tools import render_chat

HERMES = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% for call in message.tool_calls %}<tool_call>\n{{ {'name': call.function.name, 'arguments': "
    "call.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The time",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
HISTORY = [
    {"role": "user", "content": "Time in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{\"city\": \"Rome\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "14:05"},
]  # fmt: skip


class _Tokenizer:
    """What ``render_chat`` uses of a tokenizer: its template and ``apply_chat_template``."""

    def __init__(self, source: str) -> None:
        self.chat_template = source
        self._template = ChatTemplate(source)

    def apply_chat_template(self, messages: object, add_generation_prompt: bool = True, **kwargs: object) -> str:
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)


def _render(source: str, **body: object) -> str:
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": HISTORY, **body})
    return render_chat(_Tokenizer(source), req.template_messages(), req.prompt_tools(), req.has_tool_history)


def test_which_templates_read_tools() -> None:
    assert template_uses_tools(HERMES)
    assert not template_uses_tools(CHATML_TEMPLATE)
    assert not template_uses_tools("{% set tools = 1 %}{{ tools }}")  # assigned, not read from the context
    assert not template_uses_tools("{% for x in %}")  # a broken template: rendering names its error


def test_a_tool_aware_template_gets_the_tools_and_object_arguments() -> None:
    text = _render(HERMES, tools=TOOLS)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert "<tool_response>\n14:05\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    assert "<tools>" not in _render(HERMES, tools=TOOLS, tool_choice="none")  # "none": the tools are not described


def test_a_template_without_tools_gets_the_generic_prompt() -> None:
    text = _render(CHATML_TEMPLATE, tools=TOOLS)
    section = GENERIC_TOOL_PROMPT.format(tools=json.dumps(TOOLS[0], ensure_ascii=False))
    assert text.startswith(f"<|im_start|>system\n{section}<|im_end|>\n<|im_start|>user\nTime in Rome?<|im_end|>\n")
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\n14:05\n</tool_response><|im_end|>\n') in text
    assert "<|im_start|>tool" not in text
    assert "# Tools" not in _render(CHATML_TEMPLATE, tools=TOOLS, tool_choice="none")


def test_the_generic_prompt_joins_a_system_message_and_a_run_of_results() -> None:
    messages = [{"role": "system", "content": "Be brief."}, HISTORY[0],
                {"role": "assistant", "content": "Looking.", "tool_calls": [
                    {"id": "a", "function": {"name": "f", "arguments": {}}},
                    {"id": "b", "function": {"name": "g", "arguments": {"x": 1}}}]},
                {"role": "tool", "tool_call_id": "a", "content": "1"}, {"role": "tool", "tool_call_id": "b", "content": "2"}]  # fmt: skip
    out = generic_tool_messages(messages, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert out[2]["content"] == ('Looking.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
                                 '<tool_call>\n{"name": "g", "arguments": {"x": 1}}\n</tool_call>')
    assert out[3]["content"] == "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"


def test_smollm2s_own_template_renders_a_tool_conversation(served_model: object) -> None:
    tokenizer = served_model.local_tokenizer  # type: ignore[attr-defined]
    assert not template_uses_tools(tokenizer.chat_template)
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": HISTORY, "tools": TOOLS})
    text = render_chat(tokenizer, req.template_messages(), req.prompt_tools(), req.has_tool_history)
    assert "<tools>" in text and "<tool_response>" in text and "SmolLM" not in text
