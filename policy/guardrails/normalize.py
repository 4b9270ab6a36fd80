"""Text normalisation for matching (the *skeleton*), with a map back to the original text.

Rules and detectors match on a normalised copy of the text, so that obfuscation
does not slip through:

* Unicode NFKC (fullwidth ``ｓｋｉ`` -> ``ski``, ligature ``ﬁ`` -> ``fi``,
  superscripts, circled letters, ...), combining marks removed (``skí`` ->
  ``ski``), case folding (``SKI``, ``ß`` -> ``ss``), and look-alikes folded per
  Unicode's confusables table and small capitals (``ѕкі``'s ``ѕ``, ``ʙᴀᴅ``:
  ``confusables``), repeated until nothing changes;
* removal of format characters (category Cf: zero-width space/joiners, soft
  hyphen, word joiner, BOM, tag characters), the other default-ignorable code
  points (variation selectors, combining grapheme joiner, Hangul fillers),
  control characters (Cc) that are not whitespace, and lone surrogates (Cs);
* every run of whitespace collapsed to one space;
* a word spelled out letter by letter joined (``b a d``, ``b-a-d`` -> ``bad``:
  ``_SPELLED``).

Beside the skeleton, ``joined`` gives its *joined view*: the joiners (``JOINERS``:
``-``, ``.``, ``_``, ``·`` and the like) between two letters removed, so that
``blue-bird``, ``b_l_u_e`` and ``blue.bird`` read as ``bluebird`` there while the
skeleton keeps ``blue`` and ``bird`` apart (a rule for ``bird`` still fires on
``blue-bird``). The blocklist reads both (``check.scan``).

What it does not undo (documented limits, docs/security.md): leetspeak and ASCII
substitutions (``sk1``, ``$ki``), which only a regex rule can catch; Greek
capitals whose small letter looks different (case folding comes first). Removing
zero-width characters also joins words that a script separates only with them
(Thai, Khmer).

A redaction must replace the right span of the *original* text, so each
normalised character remembers the original span it came from
(``Normalized.original_span``). The mapping works on segments: a starter
character and the combining marks that follow it are normalised together, so
a segment is never split. (Hangul conjoining jamo, which compose across
starters, are left as they are; precomposed syllables are unaffected.)

ASCII, the common case, takes a quicker road to the same result: regex
substitutions instead of ``unicodedata``, and a map built only when a span is
asked for (the identity, as ``range`` objects, when nothing was dropped or
collapsed). Long ASCII runs inside other text are handled that way too; only
the rest goes segment by segment.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import re2

from inferflux.policy.guardrails import confusables

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
# What the ASCII map skips: a run of dropped characters, or a whitespace run (dropped characters
# inside it, as they vanish before runs are collapsed) that becomes one space.
_ASCII_GAP = re.compile(
    r"(?P<dropped>[\x00-\x08\x0e-\x1b\x7f]+)"
    r"|[\t\n\x0b\x0c\r\x1c-\x1f ](?:[\x00-\x1f\x7f ]*[\t\n\x0b\x0c\r\x1c-\x1f ])?"
)


def _dropped(ch: str) -> bool:
    if ord(ch) in _IGNORABLE:
        return True
    category = unicodedata.category(ch)
    # A lone surrogate (Cs) is no character at all: dropped like an invisible one, so it splits no word and
    # no search meets it (RE2 reads UTF-8, which cannot hold one).
    return category in ("Cf", "Cs") or (category == "Cc" and not ch.isspace())


# A skeleton step can expose more to fold (Cyrillic ``в`` -> small capital ``ʙ`` -> ``b``); a few
# rounds reach the fixed point for every character in the table.
_MAX_ROUNDS = 4


def _strip_marks(text: str) -> str:
    """``text`` without nonspacing and enclosing marks (accents, Zalgo stacks, keycaps), recomposed."""
    decomposed = unicodedata.normalize("NFD", text)
    kept = "".join(ch for ch in decomposed if unicodedata.category(ch) not in ("Mn", "Me"))
    return unicodedata.normalize("NFC", kept)


def _fold(segment: str) -> str:
    """One segment's skeleton: NFKC, look-alikes to their representative, case folded, marks removed."""
    text = segment
    for _ in range(_MAX_ROUNDS):
        # Case first, so that both cases of a letter share a skeleton (Greek capitals whose small letter
        # looks different, such as Β -> β, then read as the small letter, not as the Latin capital).
        # Marks go before case folding too: it turns some into letters (U+0345, ypogegrammeni, folds to iota).
        compatible = unicodedata.normalize("NFKC", _strip_marks(unicodedata.normalize("NFKC", text)).casefold())
        folded = _strip_marks("".join(map(confusables.fold, compatible)).casefold())
        if folded == text:
            break
        text = folded
    return text


# The same few non-ASCII characters (quotes, dashes, accents) come back all the time; single
# characters only, so the cache stays small whatever the text.
_fold_char = lru_cache(maxsize=4096)(_fold)


def _fold_segment(segment: str) -> str:
    if segment.isascii():
        return segment.lower()
    return _fold_char(segment) if len(segment) == 1 else _fold(segment)


@dataclass
class Normalized:
    """``text`` normalised for matching; ``original`` is what it came from."""

    original: str
    text: str
    # starts[i], ends[i]: the original span that normalised character i came from (lists, or ranges
    # for the identity map).
    _starts: Sequence[int] | None = field(default=None, repr=False)
    _ends: Sequence[int] | None = field(default=None, repr=False)
    # The skeleton before spelled-out words were joined, where any were (its joined view reads "a b-a-d" as
    # "a bad", where the skeleton has "abad").
    unspelled: Normalized | None = field(default=None, repr=False, compare=False)

    def _map(self) -> tuple[Sequence[int], Sequence[int]]:
        if self._starts is not None and self._ends is not None:
            return self._starts, self._ends
        # The ASCII fast path builds no map until a span is asked for.
        starts, ends = _ascii_map(self.original, len(self.text))
        if len(starts) != len(self.text):  # the two ASCII paths must agree: a bug, not bad input
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
        if text.isprintable() and "  " not in text:  # no control character, no run of spaces: only case changes
            norm = Normalized(text, text.lower(), range(len(text)), range(1, len(text) + 1))
        else:
            norm = Normalized(text, _fold_ascii(text))
    else:
        starts, ends, folded = _mapped(text)
        norm = Normalized(text, folded, starts, ends)
    spelled = _join_spelled(norm)
    if spelled is not norm:
        spelled.unspelled = norm
    return spelled


# A word spelled out letter by letter: two or more single letters (not glued to a word character or an
# apostrophe, so "rock 'n' roll" and "it's" stay apart), each separated from the next by one to three
# separators. Digits never join: numbers keep their groups for the PII detectors.
SEPARATORS = " .-*~+/|_\u00b7"
_SPELLED = re.compile(rf"(?<![\w'\u2019])[^\W\d_](?:[{re.escape(SEPARATORS)}]{{1,3}}[^\W\d_](?![\w'\u2019]))+")


# What every spelled-out word holds, for RE2 (no look-around): RE2 answers "none" for 2 KB of prose in
# about 4 us where ``_SPELLED`` takes 70; under ``_PREFILTER_FROM`` characters ``_SPELLED`` is quicker.
_MAY_SPELL = re2.compile(r"(?:^|[^\pL\pN_'\x{2019}])[\pL\pN][ .\-*~+/|_\x{00b7}]{1,3}[\pL\pN](?:[^\pL\pN_'\x{2019}]|$)")
_PREFILTER_FROM = 256


def _may_spell(text: str) -> bool:
    if len(text) < _PREFILTER_FROM:
        return True
    return _MAY_SPELL.search(text) is not None


def _join_spelled(norm: Normalized) -> Normalized:
    """``norm`` with the separators inside spelled-out words removed (``b a d``, ``b-a-d`` -> ``bad``)."""
    text = norm.text
    if not _may_spell(text):
        return norm
    runs = list(_SPELLED.finditer(text))
    if not runs:
        return norm
    starts, ends = norm._map()
    keep: list[int] = []
    kept = 0
    for run in runs:
        begin, end = run.span()
        keep.extend(range(kept, begin))
        keep.extend(i for i in range(begin, end) if text[i] not in SEPARATORS)
        kept = end
    keep.extend(range(kept, len(text)))
    return Normalized(
        norm.original, "".join(text[i] for i in keep), [starts[i] for i in keep], [ends[i] for i in keep]
    )


def _fold_ascii(text: str) -> str:
    return _ASCII_SPACE_RUN.sub(" ", _ASCII_DROPPED.sub("", text)).lower()


def _ascii_map(text: str, size: int, start: int = 0, stop: int | None = None) -> tuple[Sequence[int], Sequence[int]]:
    """The map of ASCII ``text[start:stop]``, whose normalised form has ``size`` characters; offsets in ``text``."""
    stop = len(text) if stop is None else stop
    if size == stop - start:  # nothing dropped or collapsed: each character is its own source
        return range(start, stop), range(start + 1, stop + 1)
    starts: list[int] = []
    ends: list[int] = []
    kept = start  # where the characters kept one for one begin
    for gap in _ASCII_GAP.finditer(text, start, stop):
        begin, end = gap.span()
        starts.extend(range(kept, begin))
        ends.extend(range(kept + 1, begin + 1))
        if gap.lastgroup != "dropped":  # a whitespace run: one space standing for all of it
            starts.append(begin)
            ends.append(end)
        kept = end
    starts.extend(range(kept, stop))
    ends.extend(range(kept + 1, stop + 1))
    return starts, ends


# A run this long is mapped in one piece (regexes) rather than character by character (unicodedata);
# either way gives the same result, the piecewise one is just slower to start.
_ASCII_RUN = re.compile(r"[\x00-\x7f]{8,}")


class _Mapping:
    """A normalised text under construction, with the original span of each character."""

    def __init__(self) -> None:
        self.parts: list[str] = []  # never empty strings
        self.starts: list[int] = []
        self.ends: list[int] = []

    def ends_in_space(self) -> bool:
        return bool(self.parts) and self.parts[-1][-1] == " "

    def add_segments(self, text: str, i: int, stop: int) -> None:
        """``text[i:stop]``, one segment (a starter and its combining marks) at a time."""
        while i < stop:
            j = i + 1
            while j < stop and unicodedata.combining(text[j]):
                j += 1
            for ch in _fold_segment(text[i:j]):
                if ch.isspace():
                    if self.ends_in_space():
                        self.ends[-1] = j  # the collapsed space stands for the whole run
                        continue
                    ch = " "
                elif _dropped(ch):
                    continue
                self.parts.append(ch)
                self.starts.append(i)
                self.ends.append(j)
            i = j

    def add_ascii(self, text: str, i: int, stop: int) -> None:
        """ASCII ``text[i:stop]`` in one piece, where no combining mark follows it."""
        folded = _fold_ascii(text[i:stop])
        if not folded:
            return
        starts, ends = _ascii_map(text, len(folded), i, stop)
        if folded[0] == " " and self.ends_in_space():  # a whitespace run that began before ``i``
            self.ends[-1] = ends[0]
            folded, starts, ends = folded[1:], starts[1:], ends[1:]
            if not folded:
                return
        self.parts.append(folded)
        self.starts.extend(starts)
        self.ends.extend(ends)


def _mapped(text: str) -> tuple[list[int], list[int], str]:
    """Normalise any text, with its map: long ASCII runs in one piece, the rest segment by segment."""
    mapping = _Mapping()
    i = 0
    for run in _ASCII_RUN.finditer(text):
        begin, end = run.span()
        mapping.add_segments(text, i, begin)
        # A combining mark after the run joins its last character's segment: leave that one to add_segments.
        i = end if end == len(text) else end - 1
        mapping.add_ascii(text, begin, i)
    mapping.add_segments(text, i, len(text))
    return mapping.starts, mapping.ends, "".join(mapping.parts)


# Joiners: what glues the pieces of one word together (``blue-bird``, ``b_l_u_e``, ``blue.bird``), as the
# skeleton writes them (dashes and hyphens fold to ``-``, bullets and middle dots to ``·``, the em dash to
# U+1173). Up to three between two letters; never next to a digit, so numbers keep their groups.
JOINERS = "-._·*~+/|\u1173"
MAX_JOINERS = 3
# How much longer than its match a blocklist hit can be in the skeleton: each character of it may be
# followed by ``MAX_JOINERS`` joiners that the joined view removed.
JOINED_SPAN = 1 + MAX_JOINERS
# Runs of joiners, found by their own characters (a scan for a character class runs in C); whether letters
# stand on both sides is then asked of the few runs there are (a look-behind first costs ten times more).
_JOINER_RUN = re.compile(f"[{re.escape(JOINERS)}]+")
# What every such run holds, for RE2: a long text without one is answered in a third of the time.
_MAY_JOIN = re2.compile(r"\pL[\-._\x{00b7}*~+/|\x{1173}]{1,3}\pL")


@dataclass(frozen=True)
class Joined:
    """The joined view of a skeleton: ``text`` with ``cuts`` (its joiner runs between letters) removed."""

    text: str
    _cut_at: tuple[int, ...]  # where each cut falls in the view
    _removed: tuple[int, ...]  # characters removed before and at each cut, summed

    def position(self, i: int) -> int:
        """The skeleton position of view position ``i`` (``len(view)`` maps to the skeleton's end)."""
        k = bisect_right(self._cut_at, i)
        return i + (self._removed[k - 1] if k else 0)


def joined(text: str) -> Joined | None:
    """The joined view of skeleton ``text`` (see the module's docstring); None when it has no joiner between
    two letters (its view is itself)."""
    if len(text) >= _PREFILTER_FROM and _MAY_JOIN.search(text) is None:
        return None
    cuts = [
        (m.start(), m.end()) for m in _JOINER_RUN.finditer(text)
        if m.end() - m.start() <= MAX_JOINERS and 0 < m.start() and m.end() < len(text)
        and text[m.start() - 1].isalpha() and text[m.end()].isalpha()
    ]  # fmt: skip
    if not cuts:
        return None
    pieces: list[str] = []
    cut_at: list[int] = []
    removed: list[int] = []
    kept = gone = 0
    for begin, end in cuts:
        pieces.append(text[kept:begin])
        cut_at.append(begin - gone)
        gone += end - begin
        removed.append(gone)
        kept = end
    pieces.append(text[kept:])
    return Joined("".join(pieces), tuple(cut_at), tuple(removed))
