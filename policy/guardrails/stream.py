"""Checking a streamed response incrementally, across chunk boundaries.

Feed the generated text as it comes (``feed``), send what each call returns,
and call ``flush`` at the end (with the last chunk, if it comes with the end).
The checker holds back the tail that a match could still be growing into and
releases the rest at once:

* For a rule whose matches may contain a space (phone and card numbers, IBANs,
  SSNs, PEM headers, blocklist phrases and regexes), the last ``H_ws``
  normalised characters, where ``H_ws`` is the longest such match plus two
  (the look-ahead a match's end depends on). With only the PII detectors that
  is 65 characters (a PEM private-key header).
* For a rule whose matches lie within one word (e-mail addresses, IPs, API
  keys, JWTs, blocklist words), only the trailing word (and, after trailing
  separators, the word before them, which a word spelled out letter by letter
  may still be growing from): a match cannot cross the space before it. A word
  longer than the longest such match plus two is released down to that bound
  (3,010 characters, a JWT; 320 for e-mail alone).

A blocklist literal read in the joined view (``b-l-u-e``, ``blue-bird``) may have
up to ``MAX_JOINERS`` joiners after each of its characters, so its bound is its
length times four (``engine``); a regex rule's is its ``max_length`` as declared.

So the hold-back is at most ``max(H_ws, min(H_word, length of the trailing
word))`` normalised characters; in prose it is about ``H_ws``. A regex rule
without an upper bound on its length counts as its ``max_length`` (default
256): a longer match split across chunks may be missed or only partly
redacted. A PEM private key is held from its BEGIN line until its END line (or
the end of the stream), so none of it is sent.

A match counts once it can no longer change, so the stream decides exactly as
a check of the whole text would: the concatenation of everything sent equals
``Guardrails.check_output(whole text).texts[0]``. On a ``block`` rule the
checker sends the clean text before the match, reports ``blocked``, and
refuses further input: end the stream with ``finish_reason:
"content_filter"``.

Chunks may be ``str`` or UTF-8 ``bytes``; a multi-byte character split across
byte chunks is reassembled before it is checked.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from inferflux.policy.guardrails.check import ScanPlan, finding, redact, scan, scan_plan
from inferflux.policy.guardrails.findings import Action, Finding, Matcher
from inferflux.policy.guardrails.normalize import SEPARATORS, Normalized, normalize

LOOKAHEAD = 2  # characters after a match that can still change it ("a@b.co" + ".uk")
CONTEXT = 24  # released characters kept so that rules can look behind ("version 1.2.3.4")


@dataclass(frozen=True)
class StreamStep:
    """What one ``feed`` or ``flush`` produced."""

    text: str  # send this now (may be empty)
    blocked: bool = False  # stop: end the stream with finish_reason "content_filter"
    findings: tuple[Finding, ...] = ()  # new findings, offsets in the whole generated text

    @property
    def reasons(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f.reason() for f in self.findings if f.action is Action.BLOCK))


def holdback(matchers: Sequence[Matcher]) -> tuple[int, int]:
    """(H_ws, H_word): the hold-back for matches that may contain spaces, and for one-word matches."""
    spaced = [m.max_length + LOOKAHEAD for m in matchers if m.spaces]
    word = [m.max_length + LOOKAHEAD for m in matchers if not m.spaces]
    return max(spaced, default=0), max(word, default=0)


class OutputStream:
    """The incremental output checker of one streamed response."""

    def __init__(
        self, matchers: Sequence[Matcher], hold: tuple[int, int] | None = None, *, plan: ScanPlan | None = None
    ) -> None:
        """``hold``: ``holdback(matchers)``, and ``plan``: ``scan_plan(matchers)``, when the caller has them
        already (they are the same for every stream)."""
        self._matchers = tuple(matchers)
        self._hold_spaced, self._hold_word = holdback(self._matchers) if hold is None else hold
        self._plan = scan_plan(self._matchers) if plan is None else plan
        self._decoder: codecs.IncrementalDecoder | None = None  # made for the first bytes chunk
        self._buffer = ""  # released context + text not yet released
        self._released = 0  # offset in _buffer where the unreleased text begins
        self._base = 0  # offset of _buffer[0] in the whole generated text
        self.blocked = False
        self.findings: list[Finding] = []

    def feed(self, chunk: str | bytes) -> StreamStep:
        """Add generated text; returns what may be sent now."""
        if self.blocked:
            return StreamStep("", blocked=True)
        if isinstance(chunk, bytes):
            if self._decoder is None:
                self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
            chunk = self._decoder.decode(chunk)
        else:
            chunk = self._pending() + chunk  # bytes left incomplete before a str
        if not self._matchers:
            return StreamStep(chunk)
        self._buffer += chunk
        return self._step(final=False)

    def flush(self, last: str | bytes = "") -> StreamStep:
        """The end of the response, with its ``last`` chunk if any: release (or block) everything held back.

        ``flush(last)`` decides as ``feed(last)`` then ``flush()`` would, in one pass instead of two:
        a whole (not streamed) answer is one chunk, most of it held back by ``feed`` anyway."""
        if self.blocked:
            return StreamStep("", blocked=True)
        if isinstance(last, bytes):
            if self._decoder is None:
                self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
            self._buffer += self._decoder.decode(last, final=True)
        else:
            self._buffer += self._pending() + last
        if not self._matchers:
            text, self._buffer = self._buffer, ""
            return StreamStep(text)
        return self._step(final=True)

    def _pending(self) -> str:
        """What is left of an incomplete UTF-8 character (as U+FFFD), ending it."""
        return "" if self._decoder is None else self._decoder.decode(b"", final=True)

    def _step(self, *, final: bool) -> StreamStep:
        norm = normalize(self._buffer)
        text = norm.text
        start = norm.position_of(self._released)
        if final:
            until = len(text)
        else:
            # The trailing word, and after trailing separators the word before them: "f u - " may still
            # become "f u - c k", which joins from its first letter on (``normalize``: a spelled-out word).
            word = len(text) - (text.rstrip(SEPARATORS).rfind(" ") + 1)
            until = max(start, len(text) - max(self._hold_spaced, min(self._hold_word, word)))
            if until == start:  # all of it held back (the first tokens of every answer): nothing to decide yet
                return StreamStep("")
        hits = scan(norm, self._plan, start)
        # Everything that starts before `until` is settled (see the module's docstring).
        blocking = next((hit for m, hit in hits if m.action is Action.BLOCK and hit.start < until), None)
        if blocking is not None:
            until = blocking.start
        for _matcher, hit in hits:
            if hit.start >= until:
                break
            if hit.end > until:
                until = hit.start  # never send part of a match: it goes out whole, in a later step
                break
        released = [(m, h) for m, h in hits if h.start < until and h.end <= until]
        if blocking is not None:
            released += [(m, h) for m, h in hits if h is blocking]
        out = redact(norm, released, start, until, self._released)
        new = tuple(finding(m, h, norm, 0, self._base) for m, h in released)
        self.findings.extend(new)
        self._advance(norm, until)
        if blocking is not None:
            self.blocked = True
        return StreamStep(out, blocked=self.blocked, findings=new)

    def _advance(self, norm: Normalized, until: int) -> None:
        keep_from = norm.original_offset(max(0, until - CONTEXT))
        self._released = norm.original_offset(until) - keep_from
        self._buffer = self._buffer[keep_from:]
        self._base += keep_from
