"""Encoded spans of a text (base64, hex), decoded so that a blocklist can read what they hide.

A policy opts in with ``"decode": ["base64", "hex"]``. A candidate is a run of the
encoding's alphabet standing on its own (not glued to other letters or digits):

* base64 (standard or URL-safe alphabet, padding optional), at least 4 characters,
  and not an ordinary word (all lowercase letters, or one capital and then
  lowercase: ``hello``, ``World``), which would otherwise be decoded by the hundred
  in prose;
* hex, an even number of at least 4 hex digits, an optional ``0x`` before them.

It counts only if its bytes are UTF-8 text: printable characters and whitespace, at
least one letter. So ``deadbeef``, a checksum or a random key decode to nothing and
cost nothing further. One level only: base64 inside hex (or inside base64) is not
unwrapped.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Iterator

_BASE64 = re.compile(r"(?<![\w+/=-])[A-Za-z0-9+/_-]{4,}={0,2}(?![\w+/=-])")
_HEX = re.compile(r"(?<![\w])(?:0[xX])?((?:[0-9A-Fa-f]{2}){2,})(?!\w)")
_URL_SAFE = str.maketrans("-_", "+/")


def _text(data: bytes) -> str | None:
    """``data`` as text, if it is UTF-8 that reads as text; None otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not any(ch.isalpha() for ch in text):
        return None
    if not all(ch.isprintable() or ch in "\t\n\r" for ch in text):
        return None
    return text


def _base64_spans(text: str) -> Iterator[tuple[int, int, str]]:
    for m in _BASE64.finditer(text):
        token = m.group().rstrip("=")
        if token.isalpha() and token[1:].islower():  # an ordinary word
            continue
        if len(token) % 4 == 1:  # no base64 is that long
            continue
        try:
            data = base64.b64decode(token.translate(_URL_SAFE) + "=" * (-len(token) % 4), validate=True)
        except (binascii.Error, ValueError):
            continue
        decoded = _text(data)
        if decoded is not None:
            yield m.start(), m.end(), decoded


def _hex_spans(text: str) -> Iterator[tuple[int, int, str]]:
    for m in _HEX.finditer(text):
        decoded = _text(bytes.fromhex(m.group(1)))
        if decoded is not None:
            yield m.start(), m.end(), decoded


# encoding -> spans of ``text`` in it: (start, end, decoded text)
DECODERS: dict[str, Callable[[str], Iterator[tuple[int, int, str]]]] = {
    "base64": _base64_spans,
    "hex": _hex_spans,
}
