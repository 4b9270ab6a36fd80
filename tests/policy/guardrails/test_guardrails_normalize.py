"""Normalisation: what it folds, and that every normalised span maps back to the right original span."""

from __future__ import annotations

import importlib
import unicodedata
from bisect import bisect_left

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferflux.policy.guardrails import normalize
from inferflux.policy.guardrails.normalize import Normalized, _dropped, _fold, _join_spelled, _mapped

# The module, not the function the package exports under the same name.
normalize_module = importlib.import_module("inferflux.policy.guardrails.normalize")


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
        ("ab\t\n\r cd", "ab cd"),
        ("ab\u00a0\u3000cd", "ab cd"),
        ("e\u0301", "e"),  # combining marks go
        ("caf\u00e9", "cafe"),
        ("\u0455k\u0456", "ski"),  # Cyrillic look-alikes (UTS #39)
        ("\u0280\u1d07\u1d05", "red"),  # small capitals
        ("s k i", "ski"),  # a word spelled out
        ("s-k-i s.k.i", "skiski"),  # two spelled words next to each other are one run
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
    norm = normalize("ab \t\n cd")
    assert norm.original_span(2, 3) == (2, 6)


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
    assert normalize(text).text == _join_spelled(Normalized(text, mapped, starts, ends)).text
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


# -- the fast paths: the same text and map as the character-by-character reference


def _reference_mapped(text: str) -> tuple[list[int], list[int], str]:
    """Normalisation one segment at a time with ``unicodedata``: how every text was mapped before."""
    out: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    n = len(text)
    i = 0
    while i < n:
        j = i + 1
        while j < n and unicodedata.combining(text[j]):
            j += 1
        segment = text[i:j]
        folded = segment.lower() if segment.isascii() else _fold(segment)
        for ch in folded:
            if ch.isspace():
                if out and out[-1] == " ":
                    ends[-1] = j
                    continue
                ch = " "
            elif _dropped(ch):
                continue
            out.append(ch)
            starts.append(i)
            ends.append(j)
        i = j
    return starts, ends, "".join(out)


def _assert_same_as_reference(text: str) -> None:
    mapped_starts, mapped_ends, mapped = _reference_mapped(text)
    reference = _join_spelled(Normalized(text, mapped, mapped_starts, mapped_ends))  # spelled words joined
    starts, ends, folded = list(reference._map()[0]), list(reference._map()[1]), reference.text
    norm = normalize(text)
    assert norm.text == folded
    assert [norm.original_span(i, i + 1) for i in range(len(folded))] == list(zip(starts, ends, strict=True))
    assert [norm.original_offset(i) for i in range(len(folded) + 1)] == [*starts, len(text)]
    assert [norm.position_of(i) for i in range(len(text) + 2)] == [
        0 if i <= 0 else bisect_left(starts, i) for i in range(len(text) + 2)
    ]


_ASCII = st.text(alphabet=st.characters(max_codepoint=0x7F), max_size=60) | st.lists(
    st.sampled_from(["Hello", " ", "  ", "\t", "\n\n", "\r\n", "\x00", "\x07", "\x1c", "\x7f", "World!", "x"]),
    max_size=20,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(_ASCII)
def test_ascii_text_maps_as_the_reference_does(text: str) -> None:
    _assert_same_as_reference(text)


# Long ASCII runs (mapped in one piece) next to combining marks, non-ASCII spaces and dropped characters.
_MIXED = st.lists(
    st.sampled_from(
        ["hello world ", "ABCDEFGHIJKLMNOP", "  ", " \x00 ", "\t\n", "\x07", "x", " ", "e", "\u0301", "\u0308\u0301",
         "\u3000", "\u00a0", "\u2028", "\u200b", "\u00ad", "\ufe0f", "ß", "ﬁ", "Ａ", "é", "İ", "Σ", "\u0345", "日本"]
    ),  # fmt: skip
    max_size=25,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(_MIXED)
def test_mixed_text_maps_as_the_reference_does(text: str) -> None:
    assert _mapped(text) == _reference_mapped(text)
    _assert_same_as_reference(text)


@pytest.mark.parametrize(
    "text",
    [
        "long ascii run e\u0301 then more",  # a combining mark right after a long ASCII run
        "twelve chars\u3000   next",  # a space run that crosses from non-ASCII into ASCII
        "abcdefghijkl   \u00a0\u3000 mnopqrstuvwx",  # ...and from ASCII into non-ASCII
        "abcdefghijkl \x00\u200b\x07  z",  # dropped characters inside a space run
    ],
)
def test_run_boundaries(text: str) -> None:
    assert _mapped(text) == _reference_mapped(text)


def test_ascii_is_mapped_without_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(text: str) -> None:
        raise AssertionError("the general path ran on ASCII text")

    monkeypatch.setattr(normalize_module, "_mapped", refuse)
    plain = normalize("Hello, World!")
    assert isinstance(plain._map()[0], range)  # the identity: nothing dropped or collapsed
    assert plain.original_span(7, 12) == (7, 12)
    spaced = normalize("Hello,\r\n\r\n  World!\x00")
    assert spaced.text == "hello, world!"
    assert spaced.original_span(6, 8) == (6, 13)
