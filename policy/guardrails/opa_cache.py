"""Remembered decisions for embedded Rego policies that are pure functions of a few input fields.

Most access policies read a handful of the input document's fields (the
model, the tenant, the roles) and nothing else that changes, so the same few
values come back request after request, and so does the answer. Evaluating
a policy, even in-process, costs tens of microseconds alone and several times
that between a model's forward passes, which evict the interpreter from the
CPU's caches; looking the answer up costs a few.

A decision may be remembered only if it cannot differ for the same values of
what the policy reads. ``cacheable_fields`` shows that from the source:

* the only module is the policy itself, with no data loaded beside it, so
  what it can read is its own rules and ``input``;
* every use of ``input`` is a field reference ``input.<name>``: then the
  policy reads only those top-level fields, and two documents that agree on
  them get the same answer. A bare ``input`` (``input[k]``,
  ``object.get(input, ...)``, ``walk(input)``, ``import input``,
  ``with input as``) could read any field, so such a policy is not cached;
* it calls no built-in whose answer depends on more than its arguments (the
  clock, randomness, the network, the runtime) or that exists for its side
  effect (``print``, ``trace``): those are told by name, so a rule of the
  policy's own with such a name turns caching off too, which costs speed,
  never correctness.

Comments and string literals are removed before the source is read, so a word
in a reason string neither enables nor disables anything.

The key is the canonical JSON of the fields the policy reads, present or not
(a missing field and a ``null`` are different to Rego). Only evaluations that
succeeded are kept. A policy edit builds a new engine, with a new, empty
cache. The cache is bounded: when full it is emptied and refills with what
recurs (a key built from a field that changes on every request, such as
``input.request_id``, never hits and only costs its lookup).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from inferflux.policy.bounded import remember

MAX_ENTRIES = 1024

# Built-ins whose answer is not a function of their arguments alone, or that are
# called for a side effect; matched by their last name, as a call.
_IMPURE_CALLS = re.compile(
    r"\b(?:now_ns|intn|rfc4122|runtime|send|lookup_ip_addr|decode_verify|"
    r"parse_and_verify_certificates(?:_with_options)?|print|trace)\s*\("
)
# A use of the input document: ``input`` as a whole word, not a field of something else.
_INPUT = re.compile(r"(?<![\w.])input\b")
_FIELD = re.compile(r"\s*\.\s*([A-Za-z_][A-Za-z0-9_]*)")
# String literals ("..." with escapes, `raw`) and comments, removed before reading.
_LITERALS_AND_COMMENTS = re.compile(r'"(?:[^"\\\n]|\\.)*"|`[^`]*`|#[^\n]*')


def cacheable_fields(rego: str) -> frozenset[str] | None:
    """The top-level input fields the policy reads, if its decision depends on nothing else; else None."""
    code = _LITERALS_AND_COMMENTS.sub(lambda m: '""' if m.group(0)[0] in '"`' else "", rego)
    if _IMPURE_CALLS.search(code):
        return None
    fields = set()
    for use in _INPUT.finditer(code):
        field = _FIELD.match(code, use.end())
        if field is None:
            return None  # the whole document, or a computed part of it
        fields.add(field.group(1))
    return frozenset(fields)


# One encoder for every key, made once: json.dumps with these options builds a new one per call.
_KEY_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)


class DecisionCache:
    """Remembered (allowed, reasons) answers of one policy version, keyed by the fields it reads.

    Made with ``fields=None`` (``cacheable_fields`` found the policy may read
    more), it remembers nothing: every key is None.
    """

    def __init__(self, fields: frozenset[str] | None, max_entries: int = MAX_ENTRIES) -> None:
        self.enabled = fields is not None
        self._fields = sorted(fields or ())
        self._max = max_entries
        self._answers: dict[str, tuple[bool, tuple[str, ...]]] = {}
        self.hits = self.misses = 0

    def key(self, document: Mapping[str, Any]) -> str | None:
        """The document's key; None when disabled or its fields cannot be written as JSON (then it is evaluated)."""
        if not self.enabled:
            return None
        present = {name: document[name] for name in self._fields if name in document}
        try:
            return _KEY_JSON.encode(present)
        except (TypeError, ValueError):
            return None

    def get(self, key: str | None) -> tuple[bool, tuple[str, ...]] | None:
        if key is None:
            return None
        found = self._answers.get(key)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def put(self, key: str | None, answer: tuple[bool, tuple[str, ...]]) -> None:
        if key is not None:
            remember(self._answers, key, answer, self._max)
