"""Look-alike characters folded to one representative, from Unicode's confusables data (UTS #39).

The data is Unicode's ``confusables.txt`` as shipped by the ``confusable-homoglyphs``
package (MIT; generated from unicode.org's security data, no code point newer than
Unicode 14.0, the version of Python 3.11's ``unicodedata``). That package keeps each
``source -> prototype`` line in both directions, which loses which side is the
prototype; but in UTS #39 each source has exactly one prototype and a prototype is
never a source, so every connected group of the table is one skeleton class: the
prototype and its sources. Any member can stand for the class as long as all of them
map to the same one, so this module picks one per class: the lowercase ASCII letter
in it if there is one (``а``, ``ɑ``, ``𝐚`` -> ``a``; the ``m`` look-alikes, whose
UTS #39 prototype is ``rn``, -> ``m``), else an ASCII character, else the shortest,
lowest member.

UTS #39 has no entry for small capitals (``ᴀ``, ``ʙ``, ``ɪ``), which read as the
letter; ``LATIN LETTER SMALL CAPITAL X`` maps to ``x`` by its Unicode name.

Only non-ASCII characters are mapped (``fold``). ASCII is what blocklists are
written in and what numbers, addresses and keys are made of, and the table's ASCII
entries (``1`` -> ``l``, ``0`` -> ``O``, ``m`` -> ``rn``) would merge digits with
letters and turn every ``m`` into ``rn``: leetspeak is not undone.
"""

from __future__ import annotations

import json
import re
import unicodedata
from functools import cache
from importlib import resources

# Bidirectional-text marks the data wraps right-to-left characters in; not part of any character.
_MARKS = str.maketrans("", "", "\u200e\u200f")
_SMALL_CAPITAL = re.compile(
    r"(?:LATIN|MODIFIER) LETTER SMALL CAPITAL ([A-Z]{1,2})|LATIN CAPITAL LETTER SMALL CAPITAL ([A-Z])"
)
# The blocks that hold Latin small capitals (IPA, phonetic extensions, Latin Extended-D/E and -F/G).
_SMALL_CAPITAL_BLOCKS = ((0x80, 0x3000), (0xA700, 0xAC00), (0x10780, 0x107C0), (0x1DF00, 0x1E000))


def _load() -> dict[str, list[str]]:
    data = resources.files("confusable_homoglyphs").joinpath("confusables.json").read_text("utf-8")
    table: dict[str, list[str]] = {}
    for key, entries in json.loads(data).items():
        source = key.translate(_MARKS)
        if source:
            table[source] = [entry["c"].translate(_MARKS) for entry in entries if entry["c"].translate(_MARKS)]
    return table


def _rank(member: str) -> tuple[int, int, str]:
    """Which member stands for its class: a lowercase ASCII letter, then an ASCII letter (``Ο``, Greek,
    reads as ``O``, not as the digit ``0`` in its class), then ASCII, then the shortest and lowest."""
    letter = len(member) == 1 and member.isascii() and member.isalpha()
    return (0 if letter and member.islower() else 1 if letter else 2 if member.isascii() else 3, len(member), member)


def _classes(table: dict[str, list[str]]) -> dict[str, str]:
    """Each single character of the table with its class's representative (union-find over the lines)."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for source, targets in table.items():
        for target in targets:
            a, b = root(source), root(target)
            if a != b:
                parent[max(a, b, key=_rank)] = min(a, b, key=_rank)
    return {member: root(member) for member in parent if len(member) == 1 and not member.isascii()}


@cache
def load() -> dict[str, str]:
    """Non-ASCII character -> its representative; built once, on the first non-ASCII character."""
    out = _classes(_load())
    for low, high in _SMALL_CAPITAL_BLOCKS:
        for code in range(low, high):
            match = _SMALL_CAPITAL.fullmatch(unicodedata.name(chr(code), ""))
            if match:
                out[chr(code)] = (match.group(1) or match.group(2)).lower()
    return out


def fold(ch: str) -> str:
    """The representative of ``ch`` if it is a non-ASCII look-alike, else ``ch``."""
    if ch.isascii():
        return ch
    return load().get(ch, ch)
