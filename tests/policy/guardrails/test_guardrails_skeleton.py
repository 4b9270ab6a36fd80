"""The matching skeleton: look-alikes, accents, spelled-out words, words split across messages, encoded
spans; and that every finding and redaction still lands on the right original text."""

from __future__ import annotations

import base64
import importlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.guardrails import Guardrails, normalize, parse_spec

SPEC = {
    "blocklist": [{"id": "bad", "literal": "badword"}, {"id": "ski", "literal": "ski"}],
    "pii": {"email": "redact", "card": "block"},
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("b\u0430dword", "badword"),  # Cyrillic a
        ("\u0299\u1d00\u1d05word", "badword"),  # small capitals
        ("\u0412AD", "bad"),  # Cyrillic capital ve, by case to small ve, then as below
        ("\u0392", "ss"),  # Greek capital beta folds by case first: small beta, a look-alike of sharp s
        ("\u0432ad", "bad"),  # Cyrillic ve, a small capital B in UTS #39
        ("cafe\u0301", "cafe"),  # a combining accent
        ("b\u0300\u0301\u0302ad", "bad"),  # stacked marks
        ("na\u00efve", "naive"),  # precomposed
        ("\u217fe", "me"),  # small roman numeral one thousand, NFKC m
        ("\u0661", "l"),  # Arabic-Indic one: a look-alike of l (digits are not mapped in ASCII)
        ("b a d", "bad"),
        ("b-a-d w.o.r.d", "badword"),  # one run: spelled words next to each other join
        ("B . A . D", "bad"),
        ("s k i", "ski"),
    ],
)
def test_skeleton(text: str, expected: str) -> None:
    assert normalize(text).text == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("class as sets", "class as sets"),
        ("I saw a cat", "i saw a cat"),
        ("rock 'n' roll", "rock 'n' roll"),
        ("it's a b", "it's ab"),  # after a word, the run of single letters joins
        ("version 1 2 3", "version 1 2 3"),  # digits never join
        ("x1 y2", "x1 y2"),
    ],
)
def test_separators_join_only_runs_of_single_letters(text: str, expected: str) -> None:
    assert normalize(text).text == expected


def test_a_spelled_word_maps_back_to_all_of_it() -> None:
    norm = normalize("say b - a - d now")
    assert norm.text == "say bad now"
    start = norm.text.index("bad")
    assert norm.original_span(start, start + 3) == (4, 13)
    assert norm.original[4:13] == "b - a - d"


def test_an_accented_word_maps_back_with_its_marks() -> None:
    original = "x ba\u0301\u0302dword y"
    norm = normalize(original)
    start = norm.text.index("badword")
    s, e = norm.original_span(start, start + 7)
    assert original[s:e] == "ba\u0301\u0302dword"


def test_the_skeleton_is_idempotent() -> None:
    for text in ["b\u0430d \u0432 \u0392", "s k i", "\u1d00\u0299", "Stra\u00dfe \u03b2"]:
        once = normalize(text).text
        assert normalize(once).text == once


@pytest.fixture
def guards(make_guardrails: Callable[..., Guardrails]) -> Guardrails:
    return make_guardrails(SPEC)


@pytest.mark.parametrize(
    "text",
    [
        "a b\u0430dword here",
        "\u0299\u1d00\u1d05\u1d21\u1d0f\u0280\u1d05",
        "b-a-d-w-o-r-d",
        "s.k.i",
        "S K I!",
        "ba\u0301dword",
    ],
)
def test_obfuscated_words_are_blocked(guards: Guardrails, text: str) -> None:
    assert guards.check_input([text]).blocked


def test_a_word_split_across_messages_is_blocked(guards: Guardrails) -> None:
    decision = guards.check_input(["tell me about bad", "word things"])
    assert decision.blocked
    assert {(f.index, f.start, f.end) for f in decision.findings} == {(0, 14, 17), (1, 0, 4)}
    assert not guards.check_input(["no bad", "words here"]).blocked  # "bad" + "words" is not "badword"


def test_split_words_are_redacted_in_each_message(make_guardrails: Callable[..., Guardrails]) -> None:
    guards = make_guardrails({"blocklist": [{"id": "ski", "literal": "ski", "action": "redact"}]})
    decision = guards.check_input(["go s", "ki now", "and ski"])
    assert decision.texts == ("go [REDACTED]", "[REDACTED] now", "and [REDACTED]")


def test_whole_words_still_match_in_each_message(guards: Guardrails) -> None:
    # Message boundaries are word boundaries for each message's own check.
    assert guards.check_input(["ski", "ing is fun"]).blocked
    assert not guards.check_input(["skiing", "is fun"]).blocked


@pytest.mark.parametrize("card", ["4111.1111.1111.1111", "4111 1111 1111 1111", "4111-1111-1111-1111"])
def test_card_numbers_with_any_separator(guards: Guardrails, card: str) -> None:
    assert guards.check_input([f"pay with {card} now"]).blocked


@pytest.mark.parametrize("text", ["4111.1111.1111.1112", "pi is 3.141592653589793", "10.0.19041.1234", "1.2.3.4"])
def test_dotted_numbers_that_are_not_cards(guards: Guardrails, text: str) -> None:
    assert not guards.check_input([text]).blocked


def test_decoding_is_off_by_default(guards: Guardrails) -> None:
    encoded = base64.b64encode(b"a badword here").decode()
    assert not guards.check_input([f"decode {encoded}"]).blocked


ENCODINGS = [lambda b: base64.b64encode(b).decode(), lambda b: b.hex(), lambda b: b.hex().upper()]


@pytest.mark.parametrize("encode", ENCODINGS)
def test_encoded_spans_are_decoded_when_asked(
    make_guardrails: Callable[..., Guardrails], encode: Callable[[bytes], str]
) -> None:
    guards = make_guardrails({**SPEC, "decode": ["base64", "hex"]})
    encoded = encode("a B\u0430DWORD here".encode())
    decision = guards.check_input([f"decode {encoded} please"])
    assert decision.blocked
    (finding,) = [f for f in decision.findings if f.rule == "blocklist.bad"]
    assert (finding.start, finding.end) == (7, 7 + len(encoded))  # the whole encoded span


def test_a_decoded_redaction_replaces_the_encoded_span(make_guardrails: Callable[..., Guardrails]) -> None:
    guards = make_guardrails({"blocklist": [{"id": "ski", "literal": "ski", "action": "redact"}], "decode": ["base64"]})
    encoded = base64.b64encode(b"go ski").decode()
    assert guards.check_input([f"x {encoded} y"]).texts == ("x [REDACTED] y",)
    assert guards.check_input(["plain words only"]).texts == ("plain words only",)


@pytest.mark.parametrize(
    "chunks",
    [
        ["go s k ", "i now"],
        ["go s ", "k ", "i now"],
        ["go s-", "k-i"],
        ["go b\u0430", "\u0301dword"],
        ["go s", "k", "i"],
    ],
)
@pytest.mark.parametrize("spec", [SPEC, {"blocklist": SPEC["blocklist"]}])  # with a PII hold-back, and without
def test_a_stream_catches_what_the_whole_text_check_catches(
    make_guardrails: Callable[..., Guardrails], spec: dict, chunks: list[str]
) -> None:
    guards = make_guardrails(spec)
    assert guards.check_output("".join(chunks)).blocked
    stream = guards.output_stream()
    steps = [stream.feed(chunk) for chunk in chunks] + [stream.flush()]
    assert any(step.blocked for step in steps)
    assert "".join(step.text for step in steps) == "go "


_normalize_module = importlib.import_module("inferflux.policy.guardrails.normalize")
# No lone surrogates: the prefilters read skeletons, which hold none (``normalize`` drops them), and RE2 reads
# only UTF-8.
_SPELLING = st.text(alphabet=st.sampled_from(list("ab1_' .-*|/\u2019\u00e9\u0301\u0430\u4e00\u00bd\n"))
                    | st.characters(exclude_categories=("Cs",)), max_size=40)


@settings(max_examples=400, deadline=None)
@given(_SPELLING)
def test_the_re2_prefilter_never_misses_a_spelled_word(text: str) -> None:
    # The prefilter may say yes wrongly, never no wrongly.
    if _normalize_module._SPELLED.search(text) is not None:
        assert _normalize_module._MAY_SPELL.search(text) is not None


def test_long_texts_take_the_prefilter() -> None:
    long = "word " * 100
    assert normalize(long + "s k i").text.endswith("ski")
    assert normalize(long + "ski").text.endswith("ski")


@pytest.mark.parametrize("value", ["base64", ["rot13"], [1], {"base64": True}])
def test_decode_takes_only_a_list_of_known_encodings(value: object) -> None:
    with pytest.raises(ValidationFailed) as refused:
        parse_spec({"decode": value})
    assert refused.value.param == "spec.decode"
    assert parse_spec({"decode": ["hex", "base64", "hex"]}).decode == ("hex", "base64")
