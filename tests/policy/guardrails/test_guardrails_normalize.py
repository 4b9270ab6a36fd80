"""Normalisation: what it folds, and that every normalised span maps back to the right original span."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.guardrails import normalize
from policy.guardrails.normalize import _mapped


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Hello  World", "hello world"),
        ("ＦＵＬＬ", "full"),
        ("ﬁne", "fine"),
        ("Straße", "strasse"),
        ("a\u200b\u200c\u200d\u2060\ufeffb", "ab"),
        ("a\u00adb", "ab"),
        ("a\x00\x07b", "ab"),
        ("a\t\n\r b", "a b"),
        ("a\u00a0\u3000b", "a b"),
        ("e\u0301", "é"),
        ("x\U000e0041y", "xy"),  # a tag character
    ],
)
def test_folds(text: str, expected: str) -> None:
    assert normalize(text).text == expected


def test_redaction_span_maps_to_the_original() -> None:
    original = "Mail: ＢＯＢ\u200b@ex.com, bye"
    norm = normalize(original)
    start = norm.text.index("bob")
    end = norm.text.index(".com") + 4
    s, e = norm.original_span(start, end)
    assert original[s:e] == "ＢＯＢ\u200b@ex.com"


def test_expanding_fold_maps_back_to_the_whole_character() -> None:
    norm = normalize("Maße")
    assert norm.text == "masse"
    assert norm.original_span(2, 3) == (2, 3)  # the first "s" of "ss" is the "ß"
    assert norm.original_span(3, 4) == (2, 3)


def test_collapsed_space_stands_for_the_whole_run() -> None:
    norm = normalize("a \t\n b")
    assert norm.original_span(1, 2) == (1, 5)


def test_a_span_outside_the_text_is_refused() -> None:
    with pytest.raises(ValueError):
        normalize("abc").original_span(2, 9)


_TEXT = st.text(
    alphabet=st.sampled_from(list("aB1 \t\n.@-_ßﬁＡ１\u200b\u00ad\x00é\u0301\u3000")) | st.characters(),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_TEXT)
def test_the_ascii_fast_path_and_the_mapped_path_agree(text: str) -> None:
    starts, ends, mapped = _mapped(text)
    assert normalize(text).text == mapped
    assert len(starts) == len(ends) == len(mapped)
    assert starts == sorted(starts) and all(s < e for s, e in zip(starts, ends, strict=True))


@settings(max_examples=300, deadline=None)
@given(_TEXT, _TEXT, _TEXT)
def test_a_span_maps_to_original_text_that_normalises_to_it(before: str, middle: str, after: str) -> None:
    norm = normalize(before + middle + after)
    if not norm.text:
        return
    # Every single normalised character comes from original text whose normalisation contains it.
    for i, ch in enumerate(norm.text):
        s, e = norm.original_span(i, i + 1)
        assert ch in normalize(norm.original[s:e]).text or ch == " "
