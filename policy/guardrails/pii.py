"""PII and secret detectors over normalised (NFKC, case-folded, whitespace-collapsed) text.

Every candidate is found with RE2 (linear time whatever the input) and then
validated in Python, so plain numbers, dates and versions are not flagged. The
one exception is an e-mail address in ASCII text, found by a linear scan from
each ``@`` that gives RE2's matches without the cost of an RE2 call
(``pii_email``):

* ``email``: ``local@domain.tld``, the TLD alphabetic. Spelled-out forms
  (``bob at example dot com``) are not detected.
* ``phone``: international numbers written with a leading ``+`` (8-15 digits,
  spaces, dots, dashes, one bracketed area code); US/NANP numbers written with
  separators (``(202) 555-0173``, ``202-555-0173``, ``+1 202 555 0173``), whose
  area code and exchange start with 2-9. A bare run of digits is not a phone
  number, so order numbers and timestamps pass.
* ``card``: 13-19 digits, optionally grouped with spaces, dashes or dots (dots
  only between groups of 3-6 digits, so decimals, addresses and versions pass),
  that pass the Luhn check and start with 2-6 (the payment-card industries).
* ``iban``: a country code with its registered length and a valid mod-97 check.
* ``ssn``: ``AAA-GG-SSSS`` (dashes or spaces, not bare), area not 000, 666 or
  900-999, group not 00, serial not 0000.
* ``ip``: IPv4 (four decimal octets 0-255 without leading zeros) and IPv6, both
  parsed by ``ipaddress``. A dotted quad right after ``v``, ``version``,
  ``release`` or ``build`` is a version number, not an address, and passes; so
  does one that is part of a longer dotted sequence (``1.2.3.4.5``).
* ``secret``: OpenAI ``sk-...``, GitHub ``ghp_``/``gho_``/``ghu_``/``ghs_``/
  ``ghr_``/``github_pat_``, AWS access key ids (``AKIA``/``ASIA``...), Slack
  ``xox?-``, Google ``AIza``, Stripe ``sk_live_``/``rk_live_``, our own
  ``ifx_<prefix>_<secret>``, JWTs (``eyJ...eyJ...sig``), and PEM
  ``-----BEGIN ... PRIVATE KEY-----`` blocks (the span runs to the END line, or
  to the end of the text when there is none).

Each detector also names what every match of it must contain (``Detector.needed``:
an ``@`` for an e-mail address, an ASCII digit for a number, a key's literal
prefix); a text without it skips the detector before any RE2 call, which is
most of the cost of checking ordinary prose.

This module lists the detectors (``DETECTORS``, in the order overlaps resolve
in); their finders are in ``pii_email``, ``pii_numbers`` (phone, card, IBAN,
SSN, IP) and ``pii_secrets``, built from what ``pii_scan`` holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from inferflux.policy.guardrails.findings import Finder, Hit
from inferflux.policy.guardrails.pii_email import EMAIL_MAX_LENGTH, find_email
from inferflux.policy.guardrails.pii_numbers import IBAN_MAX_LENGTH, find_card, find_iban, find_ip, find_phone, find_ssn
from inferflux.policy.guardrails.pii_secrets import PEM_HEADER_MAX_LENGTH, SECRET_MAX_LENGTH, SECRET_NEEDLES
from inferflux.policy.guardrails.pii_secrets import find_private_key, find_secret

PII_TYPES: tuple[str, ...] = ("secret", "card", "iban", "ssn", "email", "ip", "phone")
PLACEHOLDERS: dict[str, str] = {
    "email": "[EMAIL]",
    "phone": "[PHONE]",
    "card": "[CARD]",
    "iban": "[IBAN]",
    "ssn": "[SSN]",
    "ip": "[IP]",
    "secret": "[SECRET]",
}

# RE2's \d is ASCII-only, so a text without 0-9 holds no number these patterns match.
ASCII_DIGITS = tuple("0123456789")


def _contains_any(needles: tuple[str, ...]) -> Callable[[str], bool]:
    def contains(text: str) -> bool:
        for needle in needles:  # a plain loop: about twice as fast as any() over a generator
            if needle in text:
                return True
        return False

    return contains


class Detector(NamedTuple):
    """One PII detector and what a stream must hold back for it."""

    type: str
    find: Finder  # the RE2 search and its validation
    max_length: int  # longest match before it is settled
    spaces: bool  # whether a match may contain a space
    # A necessary condition for a match, checked in plain Python: False means ``find`` would find
    # nothing. It must hold for every text ``find`` finds something in (never stricter than ``find``).
    needed: Callable[[str], bool]

    def search(self, text: str) -> Iterator[Hit]:
        """``find``, skipped when the text cannot hold a match."""
        return self.find(text) if self.needed(text) else iter(())


# Most specific first: the order overlaps resolve in.
DETECTORS: tuple[Detector, ...] = (
    Detector("secret", find_private_key, PEM_HEADER_MAX_LENGTH, True, _contains_any(("-----begin ",))),
    Detector("secret", find_secret, SECRET_MAX_LENGTH, False, _contains_any(SECRET_NEEDLES)),
    Detector("card", find_card, 19 + 18, True, _contains_any(ASCII_DIGITS)),
    Detector("iban", find_iban, IBAN_MAX_LENGTH, True, _contains_any(ASCII_DIGITS)),
    Detector("ssn", find_ssn, 11, True, _contains_any(ASCII_DIGITS)),
    Detector("email", find_email, EMAIL_MAX_LENGTH, False, _contains_any(("@",))),
    Detector("ip", find_ip, 45, False, _contains_any(ASCII_DIGITS)),
    Detector("phone", find_phone, 48, True, _contains_any(ASCII_DIGITS)),
)
