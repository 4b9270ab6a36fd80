"""The shortest text that closes a JSON document written so far, kept up to date as it is written.

A ``json_object`` guide (``guided.Guide``) feeds it each output token's bytes,
and as ``max_tokens`` runs out asks it how many bytes closing the object takes
(``closing``), to allow only tokens that leave room for them and, at the end,
to write them itself. Pure Python: it follows compact JSON byte by byte.
"""

from __future__ import annotations

from typing import Any

# The most the shortest closing text of a JSON document grows by per byte written: after
# {"a":0 it is "}", after {"a":0, it is "\"\":0}".
JSON_CLOSE_GROWTH = 4


class JsonCloser:
    """The shortest bytes that complete the compact JSON written so far, kept as it is written.

    A stack of open containers, each in one of the states below, and the scalar being
    written, if any (a string, a number, or true/false/null). Bytes the grammar would refuse
    never arrive (the matcher saw them first), so the scanner only follows valid JSON.
    """

    __slots__ = ("stack", "scalar", "started")

    # object: "k?" after "{" (a key or "}"), "k" after "," (a key), "c" after a key (":"),
    #         "v" after ":" (a value), "n" after a value ("," or "}");
    # array:  "v?" after "[" (a value or "]"), "v" after ",", "n" after a value.
    _CLOSE_OBJECT = {"k?": b"}", "k": b'"":0}', "c": b":0}", "v": b"0}", "n": b"}"}
    _CLOSE_ARRAY = {"v?": b"]", "v": b"0]", "n": b"]"}
    _NUMBER_NEEDS_DIGIT = {"-", ".", "e", "e+"}

    def __init__(self) -> None:
        self.stack: list[list[str]] = []  # [kind, state]
        # None, or ["s", is_key, pending] (pending: b"" or the bytes an escape or a UTF-8
        # character still needs), ["#", number state], or ["l", the literal's remaining bytes]
        self.scalar: list[Any] | None = None
        self.started = False

    def closing(self) -> bytes:
        if not self.started:
            return b"{}"
        out = b""
        scalar = self.scalar
        inner_value = scalar is not None
        if scalar is not None:
            if scalar[0] == "s":
                out += scalar[2] + b'"' + (b":0" if scalar[1] else b"")
            elif scalar[0] == "#":
                out += b"0" if scalar[1] in self._NUMBER_NEEDS_DIGIT else b""
            else:
                out += scalar[1]
        for depth in range(len(self.stack) - 1, -1, -1):
            kind, state = self.stack[depth]
            if depth < len(self.stack) - 1 or inner_value:
                # a value is under way in this container (the container above, or a scalar)
                state = "n" if state in ("v", "v?") else state
                if kind == "o" and state in ("k", "k?"):  # a key under way ends with ":0" already
                    state = "n"
            out += (self._CLOSE_OBJECT if kind == "o" else self._CLOSE_ARRAY)[state]
        return out

    def feed(self, data: bytes) -> None:
        for byte in data:
            self._byte(byte)

    def _byte(self, b: int) -> None:
        scalar = self.scalar
        if scalar is not None:
            if scalar[0] == "s":
                self._string_byte(scalar, b)
                return
            if scalar[0] == "l":
                scalar[1] = scalar[1][1:]
                if not scalar[1]:
                    self.scalar = None
                    self._value_done()
                return
            if self._number_byte(scalar, b):
                return
            self.scalar = None  # the number ended: this byte is structure
            self._value_done()
        c = chr(b)
        top = self.stack[-1] if self.stack else None
        if c in "{[":
            self.started = True
            self.stack.append(["o", "k?"] if c == "{" else ["a", "v?"])
        elif c in "}]":
            self.stack.pop()
            self._value_done()
        elif c == '"':
            is_key = top is not None and top[0] == "o" and top[1] in ("k", "k?")
            self.scalar = ["s", is_key, b""]
        elif c == ":":
            if top is not None:
                top[1] = "v"
        elif c == ",":
            if top is not None:
                top[1] = "k" if top[0] == "o" else "v"
        elif c == "-" or c.isdigit():
            self.scalar = ["#", "-" if c == "-" else "int"]
        elif c in "tfn":
            self.scalar = ["l", {"t": b"rue", "f": b"alse", "n": b"ull"}[c]]

    def _string_byte(self, scalar: list[Any], b: int) -> None:
        pending: bytes = scalar[2]
        if pending:
            if pending.startswith(b"n"):  # after a backslash: one escape letter
                scalar[2] = b"0000" if b == ord("u") else b""
            elif pending.startswith(b"0"):  # \u's hex digits
                scalar[2] = pending[1:]
            else:  # UTF-8 continuation bytes
                scalar[2] = b"\x80" * (len(pending) - 1)
            return
        if b == ord('"'):
            self.scalar = None
            if scalar[1]:
                self.stack[-1][1] = "c"
            else:
                self._value_done()
        elif b == ord("\\"):
            scalar[2] = b"n"
        elif b >= 0xC0:  # a UTF-8 lead byte: its continuation bytes are still due
            count = 1 if b < 0xE0 else 2 if b < 0xF0 else 3
            # the first continuation byte's range depends on the lead (no overlong or surrogate forms)
            first = {0xE0: 0xA0, 0xF0: 0x90}.get(b, 0x80)
            scalar[2] = bytes([first]) + b"\x80" * (count - 1)

    def _number_byte(self, scalar: list[Any], b: int) -> bool:
        """Take ``b`` into the number; False where the number has ended before it."""
        state, c = scalar[1], chr(b)
        if c.isdigit():
            scalar[1] = {"-": "int", ".": "frac", "e": "exp", "e+": "exp"}.get(state, state)
            return True
        if c == "." and state == "int":
            scalar[1] = "."
            return True
        if c in "eE" and state in ("int", "frac"):
            scalar[1] = "e"
            return True
        if c in "+-" and state == "e":
            scalar[1] = "e+"
            return True
        return False

    def _value_done(self) -> None:
        if self.stack:
            self.stack[-1][1] = "n"
