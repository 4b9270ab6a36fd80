"""Blocklist rules: literal words and phrases (plain string search), and tenant regexes (RE2 only).

Both kinds match the normalised text (``normalize``), so a literal is
normalised the same way when the rule is compiled: ``"SKI"``, ``"ｓｋｉ"`` and
``"s\u200bki"`` all become ``ski``. A literal matches as a whole word by default
(``match: "word"``: not glued to a letter, digit or underscore on either side,
so ``ski`` does not fire inside ``skip``); ``match: "substring"`` drops that.

A normalised literal is found with ``str.find``: both it and the text are
already case-folded, and no two distinct characters that RE2's case-insensitive
matching would equate (``k`` and the Kelvin sign, ``s`` and long ``ſ``, ``σ``
and ``ς``...) survive normalisation, so an exact search finds what a
case-insensitive RE2 search would. A literal that is not normalised (not
produced by ``normalize_literal``) keeps the case-insensitive RE2 search.
The plain literals of a tenant's policies share a gate (``literal_gate``, used
by ``check.scan_plan``): one pass of an RE2 set of all of them tells which occur
in a text, so a text that holds none (most do) costs one search, not one per
word (500 words: 4 µs instead of 120 µs for a short prompt), and one that holds
some is searched for those alone.

Regexes are tenants' input, so they are compiled by RE2 (``google-re2``), whose
matching time is linear in the text whatever the pattern: ``(a+)+$`` cannot
stall the gateway. Python's ``re`` is never used on them. They are matched
case-insensitively against the case-folded text; RE2 has no look-around or
back-references, and ``\\b`` is ASCII-only (use ``match: "word"`` instead).
A pattern must be at most ``MAX_PATTERN_LENGTH`` characters, compile within a
small memory budget, and not match the empty string.
"""

from __future__ import annotations

import re._constants as sre_constants
import re._parser as sre_parser
from collections.abc import Iterator, Sequence

import re2

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.guardrails.findings import Finder, Hit
from inferflux.policy.guardrails.normalize import normalize

MAX_PATTERN_LENGTH = 1000
MAX_LITERAL_LENGTH = 200
MAX_PROGRAM_SIZE = 20_000  # RE2 instructions; a bigger program is refused, not slowly compiled
RE2_MAX_MEM = 4 << 20
GATE_MAX_MEM = 64 << 20  # a tenant's whole list of literals, in one program
# The longest match a stream is guaranteed to catch across chunk boundaries for a
# regex with no upper bound (``a+``); a rule may set its own ``max_length``.
DEFAULT_REGEX_MAX_LENGTH = 256


def _options(*, literal: bool) -> re2.Options:
    options = re2.Options()
    options.log_errors = False
    options.case_sensitive = False
    options.literal = literal
    options.max_mem = RE2_MAX_MEM
    return options


def compile_regex(pattern: str, param: str) -> re2._Regexp:
    """A tenant's regex, compiled by RE2; ``ValidationFailed`` naming ``param`` if it cannot be used."""
    if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_LENGTH:
        raise ValidationFailed(f"{param} must be a regex of 1 to {MAX_PATTERN_LENGTH} characters", param=param)
    try:
        regex = re2.compile(pattern, _options(literal=False))
    except re2.error as exc:
        detail = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValidationFailed(f"{param} is not a valid RE2 regex: {detail}", param=param) from None
    if regex.programsize > MAX_PROGRAM_SIZE:
        raise ValidationFailed(f"{param} is too complex (RE2 program of {regex.programsize} instructions)", param=param)
    if regex.fullmatch("") is not None:
        raise ValidationFailed(f"{param} matches the empty string, so it would match everywhere", param=param)
    return regex


def normalize_literal(literal: str, param: str) -> str:
    if not isinstance(literal, str) or not literal or len(literal) > MAX_LITERAL_LENGTH:
        raise ValidationFailed(f"{param} must be a string of 1 to {MAX_LITERAL_LENGTH} characters", param=param)
    folded = normalize(literal).text.strip()
    if not folded:
        raise ValidationFailed(f"{param} is empty once normalised (only spaces or invisible characters)", param=param)
    return folded


def regex_max_length(pattern: str) -> int | None:
    """The longest string ``pattern`` can match, if bounded and known; None otherwise.

    Python's parser only *parses* the pattern here (nothing is matched with
    ``re``); RE2 syntax it does not know (``\\pL``) gives None.
    """
    try:
        _, high = sre_parser.parse(pattern).getwidth()
    except (sre_constants.error, OverflowError, RecursionError, ValueError):
        return None
    return None if high >= sre_constants.MAXREPEAT else int(high)


def _word_byte(data: bytes, i: int, *, before: bool) -> bool:
    """Whether the character just before (or at) byte ``i`` of UTF-8 ``data`` is a word character."""
    if before:
        if i <= 0:
            return False
        j = i - 1
        while j > 0 and 0x80 <= data[j] < 0xC0:  # back to the first byte of the character
            j -= 1
        ch = data[j:i].decode("utf-8", "replace")
    else:
        if i >= len(data):
            return False
        ch = data[i : i + 4].decode("utf-8", "ignore")[:1]
    return bool(ch) and (ch.isalnum() or ch == "_")


def regex_finder(regex: re2._Regexp, *, word: bool) -> Finder:
    """Find ``regex`` (RE2) in a normalised text; with ``word``, only where not glued to a word character."""

    def find(text: str) -> Iterator[Hit]:
        data = text.encode("utf-8")
        ascii_only = len(data) == len(text)
        pos = 0
        while pos <= len(data):
            m = regex.search(data, pos)
            if m is None:
                return
            start, end = m.span()
            if end == start:  # cannot happen for a validated rule; never loop on it
                pos = start + 1
                continue
            if word and (_word_byte(data, start, before=True) or _word_byte(data, end, before=False)):
                pos = start + 1  # "skip ski": look again just after this false start
                continue
            if ascii_only:
                yield Hit(start, end, end)
            else:
                s = len(data[:start].decode("utf-8", "replace"))
                e = s + len(data[start:end].decode("utf-8", "replace"))
                yield Hit(s, e, e)
            pos = end

    return find


def _word_at(text: str, i: int) -> bool:
    """Whether ``text[i]`` exists and is a word character."""
    if 0 <= i < len(text):
        ch = text[i]
        return ch.isalnum() or ch == "_"
    return False


def literal_gate(literals: Sequence[str]) -> re2.Set | None:
    """One RE2 pass for "which of ``literals`` occur" (plain ones: exact, case-sensitive): an ``re2.Set`` whose
    ``Match`` gives their indices (None: none occurs); None if RE2 cannot take them all (then each is looked
    for on its own, as without a gate)."""
    options = _options(literal=False)
    options.case_sensitive = True  # the literals and the texts are normalised (case-folded) already
    options.max_mem = GATE_MAX_MEM
    gate = re2.Set.SearchSet(options)
    try:
        for literal in literals:
            gate.Add(re2.escape(literal))
        gate.Compile()
    except re2.error:
        return None
    return gate


def is_plain(literal: str) -> bool:
    """Whether ``literal`` is normalised, and so found by a plain string search (``string_finder``)."""
    if normalize(literal).text != literal:
        return False
    try:
        literal.encode("utf-8")  # a lone surrogate: RE2 refuses it, as it always has
    except UnicodeEncodeError:
        return False
    return True


def string_finder(literal: str, *, word: bool) -> Finder:
    """Find ``literal`` exactly (``str.find``) in a normalised text; ``word`` as for ``regex_finder``."""
    size = len(literal)

    def hits(text: str, start: int) -> Iterator[Hit]:
        while start >= 0:
            end = start + size
            if word and (_word_at(text, start - 1) or _word_at(text, end)):
                start = text.find(literal, start + 1)  # "skip ski": look again just after this false start
                continue
            yield Hit(start, end, end)
            start = text.find(literal, end)

    def find(text: str) -> Iterator[Hit]:
        # Most texts hold no blocklisted word: answer those without starting a generator.
        start = text.find(literal) if size else -1
        return iter(()) if start < 0 else hits(text, start)

    return find


def literal_finder(literal: str, *, word: bool) -> Finder:
    """``literal`` should already be normalised (``normalize_literal``): then a plain string search finds it."""
    if is_plain(literal):
        return string_finder(literal, word=word)
    return regex_finder(re2.compile(literal, _options(literal=True)), word=word)
