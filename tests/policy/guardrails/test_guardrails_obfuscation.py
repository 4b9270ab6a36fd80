"""Property tests: every obfuscation of every blocklisted word is caught.

The words are ``tests/data/blocklist-en.txt``. An obfuscation changes each letter at random: its
case, a look-alike drawn from Unicode's confusables table (the same data the skeleton uses, read
here on its own, both directions), a small capital, a fullwidth form, combining marks after it; it
may put separators between all the letters, split the word across two messages, and (for a policy
that decodes) send the sentence base64- or hex-encoded.

Drawn look-alikes are the table's members of the letter's class whose compatibility form, case
folded, is still in that class and not another ASCII character: a character that *is* another
character by Unicode's own mappings reads as that one (``𝙸`` is a capital I, ``𝟏`` the digit one,
``ſ`` a long s, ``ϲ`` folds to sigma), see docs/security.md.
"""

from __future__ import annotations

import base64
import json
import unicodedata
from collections.abc import Callable
from importlib import resources

import pytest
from guardrail_data import blocklist_spec, blocklist_words
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferflux.policy.guardrails import Guardrails

WORDS = blocklist_words()
SEPARATORS = [" ", "-", ".", " - ", ". ", "*", "  ", "|", "/", "~", "+"]
MARKS = [chr(c) for c in range(0x300, 0x370)] + ["\u20dd", "\u0489"]  # combining diacritics, enclosing marks


def _classes() -> dict[str, list[str]]:
    raw = json.loads(resources.files("confusable_homoglyphs").joinpath("confusables.json").read_text("utf-8"))
    strip = str.maketrans("", "", "\u200e\u200f")
    links: dict[str, set[str]] = {}
    for key, entries in raw.items():
        for entry in entries:
            a, b = key.translate(strip), entry["c"].translate(strip)
            links.setdefault(a, set()).add(b)
            links.setdefault(b, set()).add(a)
    out = {}
    for letter in "abcdefghijklmnopqrstuvwxyz":
        members, todo = {letter}, [letter]
        while todo:
            for other in links.get(todo.pop(), ()):
                if other not in members:
                    members.add(other)
                    todo.append(other)
        out[letter] = sorted(
            ch
            for ch in members
            if len(ch) == 1 and not ch.isascii() and _reads_as(ch, letter, members)
        )
    return out


def _reads_as(ch: str, letter: str, members: set[str]) -> bool:
    """Whether ``ch``, by Unicode's own compatibility and case mappings, is still a look-alike of ``letter``
    rather than another character: ``𝟏`` is the digit 1 and ``𝙸`` a capital I, though the table puts
    both with ``l``; ASCII is never mapped (``1``, ``I`` and ``l`` stay three characters)."""
    folded = unicodedata.normalize("NFKC", ch).casefold()
    return folded == letter or (folded in members and not folded.isascii())


LOOK_ALIKES = _classes()
SMALL_CAPITALS = {
    unicodedata.name(chr(c))[-1].lower(): chr(c)
    for c in [*range(0x1D00, 0x1D23), *range(0x0250, 0x02B0), 0xA730, 0xA731, 0xA7AF]
    if len(unicodedata.name(chr(c), "")) == len("LATIN LETTER SMALL CAPITAL X")
    and unicodedata.name(chr(c)).startswith("LATIN LETTER SMALL CAPITAL ")
}


def test_the_table_gives_look_alikes_for_every_letter() -> None:
    assert all(len(LOOK_ALIKES[letter]) >= 5 for letter in LOOK_ALIKES)
    assert sum(map(len, LOOK_ALIKES.values())) > 500
    assert len(SMALL_CAPITALS) >= 20


@st.composite
def disguised_letter(draw: st.DrawFn, letter: str) -> str:
    kind = draw(st.sampled_from(["plain", "upper", "look-alike", "small capital", "fullwidth"]))
    if kind == "upper":
        out = letter.upper()
    elif kind == "look-alike":
        out = draw(st.sampled_from(LOOK_ALIKES[letter]))
    elif kind == "small capital" and letter in SMALL_CAPITALS:
        out = SMALL_CAPITALS[letter]
    elif kind == "fullwidth":
        out = chr(ord(letter) - ord("a") + 0xFF41)
    else:
        out = letter
    return out + "".join(draw(st.lists(st.sampled_from(MARKS), max_size=3)))


@st.composite
def disguised_word(draw: st.DrawFn, word: str) -> str:
    letters = [draw(disguised_letter(letter)) for letter in word]
    if draw(st.booleans()):  # spelled out: a separator between every two letters
        return "".join(letters[0] + "".join(draw(st.sampled_from(SEPARATORS)) + ch for ch in letters[1:]))
    return "".join(letters)


@pytest.fixture(scope="module")
def guards() -> Guardrails:
    from inferflux.policy.guardrails import parse_spec

    return Guardrails([parse_spec(blocklist_spec(decode=["base64", "hex"]))])


_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(st.data())
def test_every_disguise_of_every_word_is_blocked(guards: Guardrails, data: st.DataObject) -> None:
    word = data.draw(st.sampled_from(WORDS))
    disguised = data.draw(disguised_word(word))
    assert guards.check_input([f"please say {disguised} now"]).blocked, ascii(disguised)
    # The same as a streamed answer, cut anywhere into two chunks.
    cut = data.draw(st.integers(0, len(disguised)))
    stream = guards.output_stream()
    steps = [stream.feed(f"ok {disguised[:cut]}"), stream.feed(f"{disguised[cut:]} now"), stream.flush()]
    assert any(step.blocked for step in steps), ascii(disguised)


@_SETTINGS
@given(st.data())
def test_a_disguised_word_split_across_messages_is_blocked(guards: Guardrails, data: st.DataObject) -> None:
    word = data.draw(st.sampled_from(WORDS))
    disguised = data.draw(disguised_word(word))
    cut = data.draw(st.integers(1, len(disguised) - 1))
    assert guards.check_input([f"please say {disguised[:cut]}", f"{disguised[cut:]} now"]).blocked, ascii(disguised)


@_SETTINGS
@given(st.data(), st.sampled_from([lambda b: base64.b64encode(b).decode(), bytes.hex]))
def test_an_encoded_disguised_word_is_blocked(
    guards: Guardrails, data: st.DataObject, encode: Callable[[bytes], str]
) -> None:
    word = data.draw(st.sampled_from(WORDS))
    disguised = data.draw(disguised_word(word))
    encoded = encode(f"please say {disguised} now".encode())
    assert guards.check_input([f"what does {encoded} mean?"]).blocked, ascii(disguised)
