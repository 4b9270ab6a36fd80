"""The detectors of numbers (``policy.guardrails.pii``): phone numbers, payment cards, IBANs, US social
security numbers and IP addresses.

Each finds candidates with RE2 and keeps those its validation passes (a
number's grouping, a Luhn or mod-97 check, the ranges a number may take), so
plain numbers, dates and versions are not flagged.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator

from inferflux.policy.guardrails.findings import Hit
from inferflux.policy.guardrails.pii_scan import char_after, char_before, compile_re2, is_word, isolated

_JOINERS = frozenset("+-.")

# -- phone numbers

_PHONE_INTL = compile_re2(r"\+\d{1,3}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]?\d{1,5}){1,6}")
_PHONE_US = compile_re2(r"(?:\+?1[ .-]?)?(?:\(\d{3}\) ?|\d{3}[ .-])\d{3}[ .-]\d{4}")


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
        if 8 <= len(digits) <= 15 and not is_word(char_before(text, start)) and not char_after(text, end).isdigit():
            if digits[0] != "1" or _nanp(digits):
                yield Hit(start, end, end)
    for m in _PHONE_US.finditer(text):
        start, end = m.span()
        if text[start] == "+":
            continue  # written internationally: the pattern above has judged it
        if isolated(text, start, end) and char_before(text, start) not in _JOINERS and _nanp(_digits(m.group())):
            yield Hit(start, end, end)


# -- payment cards

_DIGIT_RUN = compile_re2(r"\d+(?:[ .-]\d+)*")
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
            if found is None or is_word(char_before(text, start)) or is_word(char_after(text, groups[found][1])):
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
_IBAN_START = compile_re2(r"[a-z]{2}\d{2}")


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
        if length is None or is_word(char_before(text, start)):
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
        if len(chars) == length and not is_word(char_after(text, i)) and iban_valid("".join(chars)):
            yield Hit(start, i, i)


# -- US social security numbers

_SSN = compile_re2(r"\d{3}([ -])\d{2}([ -])\d{4}")


def ssn_valid(area: str, group: str, serial: str) -> bool:
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


def find_ssn(text: str) -> Iterator[Hit]:
    for m in _SSN.finditer(text):
        start, end = m.span()
        value = m.group()
        if m.group(1) != m.group(2) or not isolated(text, start, end):
            continue
        if char_before(text, start) == "-" or char_after(text, end) == "-":
            continue  # part of a longer dashed code
        if ssn_valid(value[0:3], value[4:6], value[7:11]):
            yield Hit(start, end, end)


# -- IP addresses

_IPV4 = compile_re2(r"\d{1,3}(?:\.\d{1,3}){3}")
_IPV6 = compile_re2(r"[0-9a-f.]*:[0-9a-f.]*:[0-9a-f:.]*")
# Matched (with Python's re, on at most 12 characters) against the text just before a dotted quad.
_VERSION_HEAD = re.compile(r"(?:^|[^\w])(?:version|release|build|ver\.?|v) ?$")


def ipv4_valid(value: str) -> bool:
    octets = value.split(".")
    return len(octets) == 4 and all(o.isdigit() and o == str(int(o)) and int(o) <= 255 for o in octets)


def find_ip(text: str) -> Iterator[Hit]:
    for m in _IPV4.finditer(text):
        start, end = m.span()
        if not ipv4_valid(m.group()) or not isolated(text, start, end):
            continue
        if char_before(text, start) == "." or (char_after(text, end) == "." and char_after(text, end + 1).isdigit()):
            continue  # one part of a longer dotted sequence
        # "version 1.2.3.4" is a version ("v1.2.3.4" is not isolated, so never got here).
        if _VERSION_HEAD.search(text[max(0, start - 12) : start]):
            continue
        yield Hit(start, end, end)
    for m in _IPV6.finditer(text):
        value = m.group().rstrip(".")
        start, end = m.start(), m.start() + len(value)
        if not any(ch.isdigit() for ch in value) or not isolated(text, start, end):
            continue
        try:
            ipaddress.IPv6Address(value)
        except ValueError:
            continue
        yield Hit(start, end, end)
