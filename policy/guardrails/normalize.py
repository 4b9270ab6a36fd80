"""Text normalisation for matching, with a map back to the original text.

Rules and detectors match on a *normalised* copy of the text, so that trivial
obfuscation does not slip through:

* Unicode NFKC (fullwidth ``ｓｋｉ`` -> ``ski``, ligature ``ﬁ`` -> ``fi``,
  superscripts, circled letters, ...), then case folding (``SKI``, ``ß`` -> ``ss``);
* removal of format characters (category Cf: zero-width space/joiners, soft
  hyphen, word joiner, BOM, tag characters), the other default-ignorable code
  points (variation selectors, combining grapheme joiner, Hangul fillers) and
  control characters (Cc) that are not whitespace;
* every run of whitespace collapsed to one space.

What it does not undo (documented limits): look-alike letters from other scripts
(Cyrillic ``а`` for Latin ``a``), accents (``skí`` stays ``skí``), leetspeak
(``sk1``), and separators inserted between letters (``s.k.i``, ``s k i``);
write a regex rule for those. Removing zero-width characters also joins words
that a script separates only with them (Thai, Khmer).

A redaction must replace the right span of the *original* text, so each
normalised character remembers the original span it came from
(``Normalized.original_span``). The mapping works on segments: a starter
character and the combining marks that follow it are normalised together, so
a segment is never split. (Hangul conjoining jamo, which compose across
starters, are left as they are; precomposed syllables are unaffected.)
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_left
from dataclasses import dataclass, field

# Default-ignorable code points outside category Cf (which is removed wholesale).
_IGNORABLE = frozenset(
    [0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x3164, 0xFFA0]
    + list(range(0x180B, 0x1810))
    + list(range(0xFE00, 0xFE10))
    + list(range(0xE0100, 0xE01F0))
)

# The ASCII fast path: the same result as the general path for ASCII text.
_ASCII_SPACE_RUN = re.compile(r"[\t\n\x0b\x0c\r\x1c-\x1f ]+")
_ASCII_DROPPED = re.compile(r"[\x00-\x08\x0e-\x1b\x7f]")


def _dropped(ch: str) -> bool:
    if ord(ch) in _IGNORABLE:
        return True
    category = unicodedata.category(ch)
    return category == "Cf" or (category == "Cc" and not ch.isspace())


def _fold(segment: str) -> str:
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", segment).casefold())


@dataclass
class Normalized:
    """``text`` normalised for matching; ``original`` is what it came from."""

    original: str
    text: str
    # starts[i], ends[i]: the original span that normalised character i came from.
    _starts: list[int] | None = field(default=None, repr=False)
    _ends: list[int] | None = field(default=None, repr=False)

    def _map(self) -> tuple[list[int], list[int]]:
        if self._starts is not None and self._ends is not None:
            return self._starts, self._ends
        # The ASCII fast path builds no map; build it now, the general way.
        starts, ends, text = _mapped(self.original)
        if text != self.text:  # the two paths must agree: a bug, not bad input
            raise RuntimeError("normalisation paths disagree")
        self._starts, self._ends = starts, ends
        return starts, ends

    def original_span(self, start: int, end: int) -> tuple[int, int]:
        """The span of ``original`` that normalised ``text[start:end]`` came from."""
        if not 0 <= start < end <= len(self.text):
            raise ValueError(f"span ({start}, {end}) is outside the normalised text")
        starts, ends = self._map()
        return starts[start], ends[end - 1]

    def position_of(self, offset: int) -> int:
        """The first normalised position whose source starts at or after original ``offset``."""
        if offset <= 0:
            return 0
        return bisect_left(self._map()[0], offset)

    def original_offset(self, position: int) -> int:
        """Where normalised position ``position`` (0..len(text)) begins in ``original``."""
        if position >= len(self.text):
            return len(self.original)
        return self._map()[0][position]


def normalize(text: str) -> Normalized:
    """Normalise ``text`` for matching (see the module's docstring)."""
    if text.isascii():
        folded = _ASCII_SPACE_RUN.sub(" ", _ASCII_DROPPED.sub("", text)).lower()
        return Normalized(text, folded)
    starts, ends, folded = _mapped(text)
    return Normalized(text, folded, starts, ends)


def _mapped(text: str) -> tuple[list[int], list[int], str]:
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
                    ends[-1] = j  # the collapsed space stands for the whole run
                    continue
                ch = " "
            elif _dropped(ch):
                continue
            out.append(ch)
            starts.append(i)
            ends.append(j)
        i = j
    return starts, ends, "".join(out)
