"""What the PII finders are built from: RE2 patterns, and the characters around a match.

Candidates are found with RE2 (linear time whatever the input), then
validated in Python; whether a candidate stands apart from the text around it
(not glued to a letter, digit or underscore) is one of those checks for most
detectors (``policy.guardrails.pii``).
"""

from __future__ import annotations

import re2


def compile_re2(pattern: str) -> re2._Regexp:
    options = re2.Options()
    options.log_errors = False  # RE2 logs to stderr itself otherwise
    return re2.compile(pattern, options)


def is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def char_before(text: str, i: int) -> str:
    return text[i - 1] if i > 0 else ""


def char_after(text: str, i: int) -> str:
    return text[i] if i < len(text) else ""


def isolated(text: str, start: int, end: int) -> bool:
    """Not glued to a letter, digit or underscore on either side."""
    return not is_word(char_before(text, start)) and not is_word(char_after(text, end))
