"""Blocklist literals are found with ``str.find``: exactly what the case-insensitive RE2 search found.

The reference is the search the literals used to run on (``regex_finder`` over an
RE2 literal, case-insensitive); every test compares the plain string search with it.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

import pytest
import re2
from hypothesis import given, settings
from hypothesis import strategies as st

from inferflux.policy.guardrails import Guardrails, normalize
from inferflux.policy.guardrails import blocklist
from inferflux.policy.guardrails.blocklist import _options, literal_finder, normalize_literal, regex_finder, string_finder
from inferflux.policy.guardrails.findings import Finder, Hit


def _re2_finder(literal: str, *, word: bool) -> Finder:
    """How literals were found before: a case-insensitive RE2 literal."""
    return regex_finder(re2.compile(literal, _options(literal=True)), word=word)


def _both(literal: str, text: str, *, word: bool) -> tuple[list[Hit], list[Hit]]:
    folded = normalize_literal(literal, "literal")
    norm = normalize(text).text
    return list(string_finder(folded, word=word)(norm)), list(_re2_finder(folded, word=word)(norm))


@pytest.mark.parametrize(
    ("literal", "text", "count"),
    [
        ("straße", "Die STRASSE und die Straße, strassen", 2),
        ("ΣΟΦΟΣ", "ο σοφος λεει ΣΟΦΟΣ σοφοσ", 3),  # final sigma folds to σ on both sides
        ("ｓｋｉ", "go SKI, go ski", 2),  # fullwidth literal
        ("ski", "go ｓｋｉ now", 1),  # fullwidth text
        ("İstanbul", "İSTANBUL and istanbul", 2),  # İ folds to i + combining dot, and the mark goes
        ("istanbul", "İSTANBUL", 1),
        ("ı", "I, ı, i", 3),  # dotless i is a look-alike of i (UTS #39)
        ("kelvin", "\u212aELVIN kelvin", 2),  # Kelvin sign: NFKC makes it K
        ("ſki", "SKI", 1),  # long s: NFKC makes it s
        ("ǅ", "Ǆ ǆ ǅ", 3),  # the dz digraph in all three cases
        ("µ", "μ, Μ, µ", 3),  # micro sign and Greek mu
        ("ᏸ", "Ᏸ ᏸ", 2),  # Cherokee folds to its capitals
        ("ΐ", "ΐ, ΐ", 2),  # iota with dialytika and tonos, in its two encodings
        ("ﬁre", "FIRE fire ﬁre", 3),
        ("Å", "\u212b, å, Å", 3),  # Angstrom sign
        ("ß", "ẞ ß ss SS", 4),
    ],
)
@pytest.mark.parametrize("word", [True, False])
def test_non_ascii_literals_match_as_before(literal: str, text: str, count: int, word: bool) -> None:
    fast, reference = _both(literal, text, word=word)
    assert fast == reference
    if word:
        assert len(fast) == count


def test_word_rule_and_false_starts() -> None:
    for text in ["skip skis ski", "ski_ ski", "éski ski", "ski2 ski", "xski ski", "ski"]:
        fast, reference = _both("ski", text, word=True)
        assert fast == reference
        assert len(fast) == 1
    # A false start that overlaps a real match: the search goes on just after the false start.
    fast, reference = _both("1.1", "x1.1.1", word=True)  # digits: letters so spaced would join
    assert fast == reference == [Hit(3, 6, 6)]
    fast, reference = _both("aa", "aaa aa", word=False)  # non-overlapping, left to right
    assert fast == reference == [Hit(0, 2, 2), Hit(4, 6, 6)]


_TRICKY = list("aAkKsSiIı _-.1ßẞσςΣµμΜǅǆǄ") + [
    "\u212a", "ſ", "İ", "\u0307", "ﬁ", "ｓ", "Ꮎ", "ꮎ", "ΐ", "ΐ", "\u200b", "é", "e\u0301",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(_TRICKY), min_size=1, max_size=4).map("".join),
    st.lists(st.sampled_from(_TRICKY), max_size=40).map("".join),
    st.booleans(),
)
def test_string_search_equals_re2_case_insensitive_search(literal: str, text: str, word: bool) -> None:
    if not normalize(literal).text.strip():
        return
    fast, reference = _both(literal, text, word=word)
    assert fast == reference


def test_normalised_literals_take_the_plain_search(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("RE2 compiled a normalised literal")

    monkeypatch.setattr(blocklist.re2, "compile", refuse)
    find = literal_finder(normalize_literal("Straße", "literal"), word=True)
    assert list(find(normalize("a STRASSE b").text)) == [Hit(2, 9, 9)]


def test_a_literal_that_is_not_normalised_keeps_the_re2_search() -> None:
    # Not something spec parsing produces, but a caller may: it still matches case-insensitively.
    find = literal_finder("SKI", word=True)
    assert list(find("go ski")) == [Hit(3, 6, 6)]


def test_re2_equates_no_two_characters_that_survive_normalisation() -> None:
    """Why ``str.find`` is exact: each RE2 case orbit has at most one member left in normalised text.

    Checked here for every character Python knows a case mapping of (an exhaustive check over all
    code points found no exception either).
    """
    cased = [
        ch
        for ch in map(chr, range(0x30000))
        if not "\ud800" <= ch <= "\udfff"
        and (ch.lower() != ch or ch.upper() != ch or ch.casefold() != ch or ch.title() != ch)
    ]
    survivors = sorted({out for ch in cased for out in normalize(ch).text})
    haystack = "".join(survivors)
    for ch in survivors:
        found = {m.group() for m in re2.compile(ch, _options(literal=True)).finditer(haystack)}
        assert found == {ch}, (f"U+{ord(ch):04X}", sorted(found))


def test_re2_knows_no_case_partner_among_characters_python_does_not_know() -> None:
    """A newer Unicode in RE2 than in Python would break the equivalence: this notices it."""
    ranges: list[list[int]] = []
    for code in range(0x20000):
        if unicodedata.category(chr(code)) == "Cn":
            if ranges and ranges[-1][1] == code - 1:
                ranges[-1][1] = code
            else:
                ranges.append([code, code])
    unassigned = re2.compile(
        "[" + "".join(f"\\x{{{a:x}}}-\\x{{{b:x}}}" for a, b in ranges) + "]", _options(literal=False)
    )
    assigned = "".join(
        ch for ch in map(chr, range(0x20000)) if not "\ud800" <= ch <= "\udfff" and unicodedata.category(ch) != "Cn"
    )
    assert [f"U+{ord(m.group()):04X}" for m in unassigned.finditer(assigned)] == []
    # Pairs that are both new (Unicode 16: Garay, Cyrillic tje) escape the check above: spot-check them.
    for upper, lower in [(0x10D50, 0x10D70), (0x1C89, 0x1C8A), (0xA7CB, 0x0264), (0xA7DC, 0x019B)]:
        if re2.compile(chr(upper), _options(literal=True)).search(chr(lower)) is not None:
            assert normalize(chr(upper)).text == normalize(chr(lower)).text


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        ({"blocklist": [{"id": "w", "literal": "ski"}]}, "we sk\ud800i today"),
        ({"pii": {"email": "block"}}, "mail bob@exa\udc00mple.com now"),
        ({"pii": {"card": "log", "secret": "block"}}, "key sk-proj-\ud800abcdefghijklmnopqrstuvwxyz012345 ok"),
    ],
)
def test_a_lone_surrogate_hides_nothing_and_fails_nothing(make_guardrails: Callable[..., Guardrails], spec: dict,
                                                          text: str) -> None:  # fmt: skip
    # No character at all: dropped like an invisible one, so it splits no word, and RE2 (UTF-8 only) never
    # meets it. (It used to raise UnicodeEncodeError, which the gateway answered 500: a model may write one
    # escaped in a tool call's arguments, which the output guardrails read decoded.)
    guardrails = make_guardrails(spec)
    assert guardrails.check_input([text]).blocked
    stream = guardrails.output_stream()
    steps = [stream.feed(text[:9]), stream.feed(text[9:]), stream.flush()]
    assert any(step.blocked for step in steps)
