"""The e-mail detector (``policy.guardrails.pii``): ``local@domain.tld``, the TLD alphabetic.

RE2 finds the candidates, except in ASCII text, where a linear scan from each
``@`` gives RE2's matches without the cost of an RE2 call
(``_ascii_email_spans``); ``find_email`` then cuts each to the longest run of
labels ending in an alphabetic TLD and drops what no address can be.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from inferflux.policy.guardrails.findings import Hit
from inferflux.policy.guardrails.pii_scan import compile_re2

# Unbounded repeats keep the RE2 program small; the lengths are checked afterwards.
_EMAIL = compile_re2(r"[\pL\pN._%+-]+@[\pL\pN-]+(?:\.[\pL\pN-]+)+")
EMAIL_LOCAL_MAX = 64
EMAIL_MAX_LENGTH = EMAIL_LOCAL_MAX + 1 + 253
# _EMAIL on ASCII text, in two halves: the local part's characters, and the domain (linear with
# ``re``: nothing follows its last repeat, so a failed repeat never makes it try the others again).
_ASCII_LOCAL = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._%+-")
_ASCII_DOMAIN = re.compile(r"[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+")


def _email_spans(text: str) -> Iterator[tuple[int, int]]:
    """Where ``_EMAIL`` matches ``text``: (start, end) of each match, in order."""
    if not text.isascii():
        return (m.span() for m in _EMAIL.finditer(text))
    return _ascii_email_spans(text)


def _ascii_email_spans(text: str) -> Iterator[tuple[int, int]]:
    """``_EMAIL``'s matches in an ASCII text without an RE2 call (whose per-call cost is most of a
    short prompt's check): from each ``@``, the run of local-part characters before it (never before
    the end of the last match, as RE2 resumes there) and the domain after it. A local part longer than
    ``EMAIL_LOCAL_MAX`` is not read to its start: ``find_email`` drops such a match, so it is skipped
    here, but the search still resumes after it, as RE2's would. Checked against RE2 by a property test."""
    resume = 0
    at = text.find("@")
    while at != -1:
        start = at
        while start > resume and at - start <= EMAIL_LOCAL_MAX and text[start - 1] in _ASCII_LOCAL:
            start -= 1
        domain = _ASCII_DOMAIN.match(text, at + 1) if start < at else None
        if domain is None:  # no match uses this @; one may use the next
            at = text.find("@", at + 1)
            continue
        if at - start <= EMAIL_LOCAL_MAX:
            yield start, domain.end()
        resume = domain.end()
        at = text.find("@", resume)


def find_email(text: str) -> Iterator[Hit]:
    for match_start, match_end in _email_spans(text):
        local, domain = text[match_start:match_end].split("@", 1)
        labels = domain.split(".")
        # The longest run of labels that ends in an alphabetic TLD: "a@b.com.123" -> "a@b.com".
        while len(labels) > 1 and not (labels[-1].isalpha() and len(labels[-1]) >= 2):
            labels.pop()
        if len(labels) < 2 or any(not label or label[0] == "-" or label[-1] == "-" for label in labels):
            continue
        if len(local) > EMAIL_LOCAL_MAX or len(".".join(labels)) > 253 or any(len(label) > 63 for label in labels):
            continue
        start = match_start + len(local) - len(local.lstrip("."))  # a local part cannot start with a dot
        end = match_start + len(local) + 1 + len(".".join(labels))
        if start < match_start + len(local):
            yield Hit(start, end, end)
