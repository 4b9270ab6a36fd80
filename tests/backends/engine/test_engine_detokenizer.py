"""Incremental detokenisation against the real SmolLM2 byte-level BPE tokenizer."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferflux.backends.engine import IncrementalDetokenizer, SamplingParams

from engine_testkit import smollm2_tokenizer

FFFD = "\ufffd"
TEXTS = [
    "Hello world! 🦀🦀 日本語のテキスト 👨‍👩‍👧 naïve café",
    "数学は美しい。𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and emoji 🎉🎊🥳 mixed with ASCII.",
    "plain ascii text with  double  spaces\nand\ttabs",
]


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def stream(tok, ids, params=None, prompt=None, finish_at_end=True):
    """Feed ids one by one; returns (deltas, finish_reason, detokenizer)."""
    params = params or SamplingParams(max_tokens=None)
    prompt = prompt if prompt is not None else tok.encode("<|im_start|>assistant\n")
    d = IncrementalDetokenizer(tok, prompt, params, tok.eos_token_ids)
    deltas, reason = [], None
    for t in ids:
        reason = d.append(t)
        deltas.append(d.take_delta())
        if reason:
            break
    if reason is None and finish_at_end:
        reason = d.finish("length")
        deltas.append(d.take_delta())
    return deltas, reason, d


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode_without_replacement_chars(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert any(FFFD in tok.decode([i]) for i in ids) or text == TEXTS[2]  # the test must split characters
    deltas, reason, d = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert d.text == text
    assert not any(FFFD in x for x in deltas)
    assert reason == "length"


def test_first_token_keeps_its_leading_space(tok):
    ids = tok.encode(" world", add_special_tokens=False)
    deltas, _, _ = stream(tok, ids, prompt=tok.encode("Hello", add_special_tokens=False))
    assert "".join(deltas) == " world"


def test_length_cut_mid_character_flushes_what_decode_gives(tok):
    ids = tok.encode("ok 🦀", add_special_tokens=False)[:-1]  # drop the crab's last byte token
    deltas, reason, _ = stream(tok, ids)
    assert reason == "length"
    assert not any(FFFD in x for x in deltas[:-1])  # held while streaming ...
    assert "".join(deltas) == tok.decode(ids)  # ... released at the end, as decode shows it


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("The answer is 42. Done", ["is 42"], "The answer "),
        ("The answer is 42. Done", [". Do", "answer"], "The "),
        ("abc 🦀 crab and more", ["🦀"], "abc "),
        ("日本語のテキスト", ["のテ"], "日本語"),
        ("no match here", ["zzz"], "no match here"),
    ],
)
def test_stop_strings_cut_text_and_never_leak(tok, text, stop, expected):
    ids = tok.encode(text, add_special_tokens=False)
    deltas, reason, d = stream(tok, ids, SamplingParams(stop=stop, max_tokens=None))
    assert "".join(deltas) == expected == d.text
    assert reason == ("length" if expected == text else "stop")
    # The one that matched first in the text, whatever its place in the list.
    assert d.stop_string == (None if expected == text else next(s for s in stop if text.find(s) == len(expected)))
    emitted = ""
    for x in deltas:
        emitted += x
        assert expected.startswith(emitted)  # nothing past the cut was ever shown
        assert FFFD not in x


def test_partial_stop_string_is_held_then_released(tok):
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP!"]), tok.eos_token_ids)
    shown = ""
    for t in tok.encode("go ST", add_special_tokens=False):
        d.append(t)
        shown += d.take_delta()
    assert shown == "go "  # "ST" could start "STOP!"
    for t in tok.encode("ATE", add_special_tokens=False):
        d.append(t)
        shown += d.take_delta()
    assert shown == "go STATE"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=st.sampled_from(list("ab cé日本🦀🎉\n.")), min_size=1, max_size=30),
    data=st.data(),
)
def test_random_text_and_stop_strings(tok, text, data):
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    stops = data.draw(st.lists(st.text(alphabet=st.sampled_from(list("ab cé日🦀.")), min_size=1, max_size=4), max_size=3))
    deltas, reason, _ = stream(tok, ids, SamplingParams(stop=stops, max_tokens=None))
    joined = "".join(deltas)
    assert full.startswith(joined)
    assert not any(s in joined for s in stops)  # generation stops at the first stop string to appear
    if reason == "stop":
        assert any(full[len(joined) :].startswith(s) for s in stops)
    else:
        assert joined == full and not any(s in full for s in stops)
    assert not any(FFFD in x for x in deltas)


def test_eos_and_stop_token_ids_end_without_text(tok):
    hello = tok.encode("Hello", add_special_tokens=False)
    eos = next(iter(tok.eos_token_ids))
    deltas, reason, d = stream(tok, hello + [eos] + hello)
    assert reason == "stop" and "".join(deltas) == "Hello" and d.stop_string is None
    deltas, reason, _ = stream(tok, hello + [eos] + hello, SamplingParams(ignore_eos=True, skip_special_tokens=True))
    assert reason == "length" and "".join(deltas) == "HelloHello"
    ids = tok.encode("Hello world again", add_special_tokens=False)
    deltas, reason, d = stream(tok, ids, SamplingParams(stop_token_ids=[ids[1]]))
    assert reason == "stop" and "".join(deltas) == "Hello" and d.num_output_tokens == 2


def test_min_tokens_defers_every_stop_condition(tok):
    hello = tok.encode("Hello", add_special_tokens=False)
    eos = next(iter(tok.eos_token_ids))
    # eos as the 1st token while min_tokens=2: treated as text, not a stop
    d = IncrementalDetokenizer(tok, [], SamplingParams(min_tokens=2), tok.eos_token_ids)
    assert d.append(eos) is None
    assert d.append(hello[0]) is None
    assert d.append(eos) == "stop"
    # a stop string completed before min_tokens is ignored
    ids = tok.encode("ab ab ab", add_special_tokens=False)
    deltas, reason, _ = stream(tok, ids, SamplingParams(stop=["ab"], min_tokens=len(ids) + 1))
    assert reason == "length" and "".join(deltas) == "ab ab ab"
    # from the min_tokens-th token on, a stop string completed by it counts (as vLLM)
    deltas, reason, _ = stream(tok, ids, SamplingParams(stop=["ab"], min_tokens=len(ids)))
    assert reason == "stop" and "".join(deltas) == "ab ab "


def test_special_tokens_shown_when_not_skipped(tok):
    ids = tok.encode("<|im_start|>hi", add_special_tokens=False)
    deltas, _, _ = stream(tok, ids, SamplingParams(skip_special_tokens=False, ignore_eos=True))
    assert "".join(deltas) == "<|im_start|>hi"
    deltas, _, _ = stream(tok, ids, SamplingParams(skip_special_tokens=True))
    assert "".join(deltas) == "hi"


def test_long_streams_trim_their_id_window(tok):
    text = "word " * 500 + "🦀"
    ids = tok.encode(text, add_special_tokens=False)
    deltas, _, d = stream(tok, ids)
    assert "".join(deltas) == text
    assert len(d._ids) < 100
