"""PII and secret detectors over normalised (NFKC, case-folded, whitespace-collapsed) text.

Every candidate is found with RE2 (linear time whatever the input) and then
validated in Python, so plain numbers, dates and versions are not flagged. The
one exception is an e-mail address in ASCII text, found by a linear scan from
each ``@`` that gives RE2's matches without the cost of an RE2 call
(``_ascii_email_spans``):

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
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

import re2

from inferflux.policy.guardrails.findings import Finder, Hit

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


def _re(pattern: str) -> re2._Regexp:
    options = re2.Options()
    options.log_errors = False  # RE2 logs to stderr itself otherwise
    return re2.compile(pattern, options)


def _word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def _before(text: str, i: int) -> str:
    return text[i - 1] if i > 0 else ""


def _after(text: str, i: int) -> str:
    return text[i] if i < len(text) else ""


_JOINERS = frozenset("+-.")


def _isolated(text: str, start: int, end: int) -> bool:
    """Not glued to a letter, digit or underscore on either side."""
    return not _word(_before(text, start)) and not _word(_after(text, end))


# -- e-mail

# Unbounded repeats keep the RE2 program small; the lengths are checked afterwards.
_EMAIL = _re(r"[\pL\pN._%+-]+@[\pL\pN-]+(?:\.[\pL\pN-]+)+")
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


# -- phone numbers

_PHONE_INTL = _re(r"\+\d{1,3}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]?\d{1,5}){1,6}")
_PHONE_US = _re(r"(?:\+?1[ .-]?)?(?:\(\d{3}\) ?|\d{3}[ .-])\d{3}[ .-]\d{4}")


def _digits(value: str) -> str:
    return "".join(ch for ch in value if ch.isdigit())


def _nanp(digits: str) -> bool:
    if len(digits) == 11 and digits[0] == "1":
        digits = digits[1:]
    return len(digits) == 10 and digits[0] in "23456789" and digits[3] in "23456789"


def find_phone(text: str) -> Iterator[Hit]:
    for m in _PHONE_INTL.finditer(text):
        start, value = m.start(), m.group()
        # Digits glued on by a separator ("+44 20 7946 0958 2024") are not part of the number.
        while len(_digits(value)) > 15 and max(value.rfind(" "), value.rfind("."), value.rfind("-")) > 0:
            value = value[: max(value.rfind(" "), value.rfind("."), value.rfind("-"))]
        end = start + len(value)
        digits = _digits(value)
        if 8 <= len(digits) <= 15 and not _word(_before(text, start)) and not _after(text, end).isdigit():
            if digits[0] != "1" or _nanp(digits):
                yield Hit(start, end, end)
    for m in _PHONE_US.finditer(text):
        start, end = m.span()
        if text[start] == "+":
            continue  # written internationally: the pattern above has judged it
        if _isolated(text, start, end) and _before(text, start) not in _JOINERS and _nanp(_digits(m.group())):
            yield Hit(start, end, end)


# -- payment cards

_DIGIT_RUN = _re(r"\d+(?:[ .-]\d+)*")
# Digit groups joined by dots are a card number only as printed on one (``4111.1111.1111.1111``): groups
# of three to six digits, all joined by dots; so decimals (``3.14159...``), addresses and versions are not.
_DOTTED_GROUP = range(3, 7)


def luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _groups(run: str, offset: int) -> list[tuple[int, int]]:
    spans = []
    i = 0
    for part in run.replace("-", " ").replace(".", " ").split(" "):
        spans.append((offset + i, offset + i + len(part)))
        i += len(part) + 1
    return spans


def _printed_as_card(text: str, groups: list[tuple[int, int]]) -> bool:
    """Whether consecutive ``groups`` are written as a card number could be: dots only as a card prints them."""
    joiners = {text[end] for (_, end) in groups[:-1]}
    if "." not in joiners:
        return True
    return joiners == {"."} and all(end - start in _DOTTED_GROUP for start, end in groups)


def find_card(text: str) -> Iterator[Hit]:
    # A number may sit among other digit groups ("card 4111 1111 1111 1111 exp 2027"),
    # so every run of consecutive groups is tried, from each group on. Only the
    # characters around a candidate decide, never the far end of a long run.
    for m in _DIGIT_RUN.finditer(text):
        groups = _groups(m.group(), m.start())
        i = 0
        while i < len(groups):
            found = None
            digits = ""
            for j in range(i, len(groups)):
                digits += text[groups[j][0] : groups[j][1]]
                if len(digits) > 19:
                    break
                if len(digits) >= 13 and digits[0] in "23456" and luhn(digits):
                    if _printed_as_card(text, groups[i : j + 1]):
                        found = j
            start = groups[i][0]
            if found is None or _word(_before(text, start)) or _word(_after(text, groups[found][1])):
                i += 1
                continue
            yield Hit(start, groups[found][1], groups[found][1])
            i = found + 1


# -- IBAN

_IBAN_LENGTHS = {
    "ad": 24, "ae": 23, "al": 28, "at": 20, "az": 28, "ba": 20, "be": 16, "bg": 22, "bh": 22, "br": 29,
    "by": 28, "ch": 21, "cr": 22, "cy": 28, "cz": 24, "de": 22, "dk": 18, "do": 28, "ee": 20, "eg": 29,
    "es": 24, "fi": 18, "fo": 18, "fr": 27, "gb": 22, "ge": 22, "gi": 23, "gl": 18, "gr": 27, "gt": 28,
    "hr": 21, "hu": 28, "ie": 22, "il": 23, "iq": 23, "is": 26, "it": 27, "jo": 30, "kw": 30, "kz": 20,
    "lb": 28, "lc": 32, "li": 21, "lt": 20, "lu": 20, "lv": 21, "ly": 25, "mc": 27, "md": 24, "me": 22,
    "mk": 19, "mr": 27, "mt": 31, "mu": 30, "nl": 18, "no": 15, "pk": 24, "pl": 28, "ps": 29, "pt": 25,
    "qa": 29, "ro": 24, "rs": 22, "sa": 24, "sc": 31, "se": 24, "si": 19, "sk": 24, "sm": 27, "st": 25,
    "sv": 28, "tl": 23, "tn": 24, "tr": 26, "ua": 29, "va": 22, "vg": 24, "xk": 20,
}  # fmt: skip
IBAN_MAX_LENGTH = 34 + 8  # 34 characters, printed in groups of four
_IBAN_START = _re(r"[a-z]{2}\d{2}")


def iban_valid(value: str) -> bool:
    """``value``: letters and digits only, any case."""
    value = value.upper()
    if _IBAN_LENGTHS.get(value[:2].lower()) != len(value) or not value.isalnum() or not value.isascii():
        return False
    rearranged = value[4:] + value[:4]
    return int("".join(str(int(ch, 36)) for ch in rearranged)) % 97 == 1


def find_iban(text: str) -> Iterator[Hit]:
    for m in _IBAN_START.finditer(text):
        start = m.start()
        length = _IBAN_LENGTHS.get(m.group()[:2])
        if length is None or _word(_before(text, start)):
            continue
        chars: list[str] = []
        i = start
        # Letters and digits, with single spaces allowed between them, up to the country's length.
        while i < len(text) and len(chars) < length:
            ch = text[i]
            if ch.isascii() and ch.isalnum():
                chars.append(ch)
            elif not (ch == " " and chars and i + 1 < len(text) and text[i + 1].isalnum()):
                break
            i += 1
        if len(chars) == length and not _word(_after(text, i)) and iban_valid("".join(chars)):
            yield Hit(start, i, i)


# -- US social security numbers

_SSN = _re(r"\d{3}([ -])\d{2}([ -])\d{4}")


def ssn_valid(area: str, group: str, serial: str) -> bool:
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


def find_ssn(text: str) -> Iterator[Hit]:
    for m in _SSN.finditer(text):
        start, end = m.span()
        value = m.group()
        if m.group(1) != m.group(2) or not _isolated(text, start, end):
            continue
        if _before(text, start) == "-" or _after(text, end) == "-":
            continue  # part of a longer dashed code
        if ssn_valid(value[0:3], value[4:6], value[7:11]):
            yield Hit(start, end, end)


# -- IP addresses

_IPV4 = _re(r"\d{1,3}(?:\.\d{1,3}){3}")
_IPV6 = _re(r"[0-9a-f.]*:[0-9a-f.]*:[0-9a-f:.]*")
# Matched (with Python's re, on at most 12 characters) against the text just before a dotted quad.
_VERSION_HEAD = re.compile(r"(?:^|[^\w])(?:version|release|build|ver\.?|v) ?$")


def ipv4_valid(value: str) -> bool:
    octets = value.split(".")
    return len(octets) == 4 and all(o.isdigit() and o == str(int(o)) and int(o) <= 255 for o in octets)


def find_ip(text: str) -> Iterator[Hit]:
    for m in _IPV4.finditer(text):
        start, end = m.span()
        if not ipv4_valid(m.group()) or not _isolated(text, start, end):
            continue
        if _before(text, start) == "." or (_after(text, end) == "." and _after(text, end + 1).isdigit()):
            continue  # one part of a longer dotted sequence
        # "version 1.2.3.4" is a version ("v1.2.3.4" is not isolated, so never got here).
        if _VERSION_HEAD.search(text[max(0, start - 12) : start]):
            continue
        yield Hit(start, end, end)
    for m in _IPV6.finditer(text):
        value = m.group().rstrip(".")
        start, end = m.start(), m.start() + len(value)
        if not any(ch.isdigit() for ch in value) or not _isolated(text, start, end):
            continue
        try:
            ipaddress.IPv6Address(value)
        except ValueError:
            continue
        yield Hit(start, end, end)


# -- secrets

_TOKEN = r"[a-z0-9_-]"
# Each shape, with the literal text every match of it contains (one of them): a
# change to a pattern must keep its needles true (tests check them on samples).
_SECRET_SHAPES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (rf"sk-(?:proj-|svcacct-|admin-)?{_TOKEN}{{20,200}}", ("sk-",)),
    (r"gh[pousr]_[a-z0-9]{36,251}", ("ghp_", "gho_", "ghu_", "ghs_", "ghr_")),
    (r"github_pat_[a-z0-9_]{22,240}", ("github_pat_",)),
    (r"(?:akia|asia|abia|acca)[a-z0-9]{16}", ("akia", "asia", "abia", "acca")),
    (r"xox[abprs]-[a-z0-9-]{10,200}", ("xox",)),
    (rf"aiza{_TOKEN}{{35}}", ("aiza",)),
    (r"(?:sk|rk)_live_[a-z0-9]{16,200}", ("_live_",)),
    (r"ifx_[a-z2-7]{12}_[a-z0-9]{43}", ("ifx_",)),
    (rf"eyj{_TOKEN}{{8,1000}}\.eyj{_TOKEN}{{8,1000}}\.{_TOKEN}{{0,1000}}", ("eyj",)),
)
_SECRETS = _re("|".join(pattern for pattern, _ in _SECRET_SHAPES))
SECRET_NEEDLES = tuple(needle for _, needles in _SECRET_SHAPES for needle in needles)
SECRET_MAX_LENGTH = 3 + 1000 + 4 + 1000 + 1 + 1000  # the longest shape above (a JWT)
_PEM_BEGIN = _re(r"-----begin [a-z0-9 ]{0,40}private key-----")
_PEM_END = _re(r"-----end [a-z0-9 ]{0,40}private key-----")
PEM_HEADER_MAX_LENGTH = 63


def find_secret(text: str) -> Iterator[Hit]:
    for m in _SECRETS.finditer(text):
        start, end = m.span()
        if not _isolated(text, start, end) or _before(text, start) == "-" or _after(text, end) == "-":
            continue
        if m.group().startswith(("sk-", "xox")) and not any(ch.isdigit() for ch in m.group()):
            continue  # "sk-learn-and-friends" is a word, not a key
        yield Hit(start, end, end)


def find_private_key(text: str) -> Iterator[Hit]:
    for m in _PEM_BEGIN.finditer(text):
        start, header_end = m.span()
        closing = _PEM_END.search(text, header_end)
        if closing is None:
            yield Hit(start, len(text), header_end, closed=False)
        else:
            yield Hit(start, closing.end(), header_end)


# -- the detectors

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
