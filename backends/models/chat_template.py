"""Rendering a model's Jinja chat template the way Hugging Face transformers does.

Templates ship inside model files, so they are untrusted code: they run in jinja2's
``ImmutableSandboxedEnvironment`` and every failure -- syntax, a ``raise_exception`` call,
a sandbox violation, a type error on odd messages -- surfaces as ``ChatTemplateError``.
The environment mirrors transformers' (trim_blocks, lstrip_blocks, loop controls, a
``tojson`` that does not HTML-escape, ``raise_exception``, ``strftime_now``) so a template
renders here exactly as it does there.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inferflux.backends.models.errors import ChatTemplateError

__all__ = ["CHATML_TEMPLATE", "ChatTemplate", "ChatTemplateError", "template_variables", "validate_messages"]

# Used when a model ships no template: ChatML, which most small instruct models speak.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _TemplateRaised(Exception):
    """A template called ``raise_exception``: its message is meant for the user verbatim."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, '), which would corrupt tool schemas in a prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTagExtension(jinja2.ext.Extension):
    """Accept transformers' ``{% generation %}...{% endgeneration %}`` (it marks assistant spans
    for training masks) and render just the body, so such templates do not fail to parse."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTagExtension, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its context (``messages``, ``tools``, ...); ChatTemplateError
    if it does not parse."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error (line {e.lineno}): {e.message}") from e


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return normalised copies.

    Each message needs a non-empty string ``role`` and a ``content`` that is a string or a
    list of ``{"type": "text", "text": ...}`` parts; parts are joined with newlines so every
    template sees a plain string. An assistant message carrying ``tool_calls`` may omit
    content. Other keys (``name``, ``tool_calls``, ``tool_call_id``) pass through.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
        normalised = dict(message)
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            normalised["content"] = None
        elif isinstance(content, str):
            pass
        elif isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise ChatTemplateError(
                        f"messages[{i}].content[{j}] has type {kind!r}; only text parts are supported"
                    )
                if not isinstance(part.get("text"), str):
                    raise ChatTemplateError(f"messages[{i}].content[{j}].text must be a string")
                texts.append(part["text"])
            normalised["content"] = "\n".join(texts)
        else:
            raise ChatTemplateError(
                f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}"
            )
        out.append(normalised)
    return out


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None) -> None:
        self.source = source
        # Templates test e.g. `{% if bos_token %}`: absent tokens render as "" the way HF passes them.
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template has a syntax error (line {e.lineno}): {e.message}") from e
        except Exception as e:  # the template is model-supplied: any compile failure is its fault
            raise ChatTemplateError(f"chat template cannot be compiled: {e}") from e

    def render(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages``; extra ``kwargs`` (``tools``, ``documents``, ``enable_thinking``,
        ...) become template variables, and may override the special-token variables."""
        chat = validate_messages(messages)
        context: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=chat, add_generation_prompt=add_generation_prompt, **context)
        except _TemplateRaised as e:
            raise ChatTemplateError(f"chat template rejected the conversation: {e}") from e
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template attempted an unsafe operation: {e}") from e
        except Exception as e:  # untrusted template code: nothing it does may crash the caller
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e
