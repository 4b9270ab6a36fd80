"""Chat templates: transformers-identical rendering, message validation, and the sandbox."""

from __future__ import annotations

import datetime
import json

import pytest

import models_testutil as util
from inferflux.backends.models import ChatTemplateError, Tokenizer
from inferflux.backends.models.chat_template import CHATML_TEMPLATE, ChatTemplate, validate_messages

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "unicode 日本語 😀\nnew line\n"},
     {"role": "assistant", "content": "  ok  "}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_matches_transformers(our_tokenizer, hf_tokenizer, conversation, add_generation_prompt):
    ours = our_tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert our_tokenizer.has_chat_template


def test_default_model_prompt_shape(our_tokenizer):
    text = our_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert our_tokenizer.encode(text)[:1] == [1]


def test_text_parts_are_joined(our_tokenizer):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert our_tokenizer.apply_chat_template([{"role": "user", "content": parts}]) == \
        our_tokenizer.apply_chat_template([{"role": "user", "content": "first\nsecond"}])


@pytest.mark.parametrize("messages,message", [
    ("hello", "messages must be a list"),
    ({"role": "user", "content": "x"}, "messages must be a list"),
    ([], "must not be empty"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "x"}], r"messages\[0\]\.role must be a non-empty string"),
    ([{"role": "", "content": "x"}], r"role must be a non-empty string"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], r"messages\[1\]\.content must be a string"),
    ([{"role": "user"}], r"messages\[0\]\.content must be a string or a list of text parts, got NoneType"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"content\[0\] has type 'image_url'; only text parts are supported"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"content\[0\]\.text must be a string"),
    ([{"role": "user", "content": ["bare string"]}], r"content\[0\] has type 'str'"),
])
def test_bad_messages(our_tokenizer, messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        our_tokenizer.apply_chat_template(messages)


def test_validation_copies_and_keeps_extra_keys():
    original = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                {"role": "tool", "content": "42", "tool_call_id": "1"}]
    out = validate_messages(original)
    assert out == original and out[0] is not original[0]


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set x = messages.append({'role': 'x'}) %}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
])
def test_sandbox_escapes_are_template_errors(template):
    with pytest.raises(ChatTemplateError, match="unsafe operation|failed to render"):
        ChatTemplate(template).render([{"role": "user", "content": "x"}])


def test_runaway_range_is_a_template_error():
    with pytest.raises(ChatTemplateError, match="range too big|failed to render"):
        ChatTemplate("{% for i in range(10**9) %}x{% endfor %}").render([{"role": "user", "content": "x"}])


def test_raise_exception_message_reaches_the_user():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start "
                     "with a user turn') }}{% endif %}ok")
    assert t.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="Conversation must start with a user turn"):
        t.render([{"role": "assistant", "content": "x"}])


def test_syntax_error():
    with pytest.raises(ChatTemplateError, match=r"syntax error \(line 1\)"):
        ChatTemplate("{% for m in messages %}{{ m }")


def test_runtime_type_error():
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])


def test_environment_matches_transformers():
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    # tojson must not HTML-escape, and takes transformers' extra arguments
    tools = [{"name": "f", "description": "a<b> & 'c' ü"}]
    assert ChatTemplate("{{ tools | tojson }}").render(msgs, tools=tools) == json.dumps(tools, ensure_ascii=False)
    assert ChatTemplate("{{ tools | tojson(indent=2) }}").render(msgs, tools=tools) == \
        json.dumps(tools, ensure_ascii=False, indent=2)
    # trim_blocks + lstrip_blocks
    assert ChatTemplate("  {% if true %}\nA\n  {% endif %}\nB").render(msgs) == "A\nB"
    # loop controls
    assert ChatTemplate("{% for m in messages %}{{ m.content }}{% break %}{% endfor %}").render(msgs) == "a"
    # {% generation %} blocks render their body
    assert ChatTemplate("{% generation %}G{% endgeneration %}").render(msgs) == "G"
    assert ChatTemplate("{{ strftime_now('%Y') }}").render(msgs) == str(datetime.datetime.now().year)
    # kwargs become variables; tools/documents default to None
    assert ChatTemplate("{{ enable_thinking }} {{ tools }} {{ documents }}").render(msgs, enable_thinking=False) == \
        "False None None"
    assert ChatTemplate("{% if add_generation_prompt %}G{% endif %}").render(msgs, add_generation_prompt=False) == ""


def test_special_token_variables(our_tokenizer):
    assert ChatTemplate("{{ bos_token }}{{ eos_token }}", {"bos_token": our_tokenizer.bos_token,
                        "eos_token": our_tokenizer.eos_token}).render([{"role": "user", "content": "x"}]) == \
        "<|im_start|><|im_end|>"
    t = ChatTemplate("{{ bos_token }}|{{ eos_token }}|{{ unk_token }}",
                     {"bos_token": "<s>", "eos_token": "</s>", "unk_token": None})
    assert t.render([{"role": "user", "content": "x"}]) == "<s>|</s>|"
    assert ChatTemplate("{{ bos_token }}", {"bos_token": "<s>"}).render(
        [{"role": "user", "content": "x"}], bos_token="[B]") == "[B]"


def test_fallback_chatml_when_the_model_has_none():
    tok = Tokenizer.from_gguf_metadata(util.tiny_byte_level_vocab(), "tiny")
    assert not tok.has_chat_template and tok.chat_template == CHATML_TEMPLATE
    assert tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == \
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template([{"role": "user", "content": "u"}], add_generation_prompt=False) == \
        "<|im_start|>user\nu<|im_end|>\n"
