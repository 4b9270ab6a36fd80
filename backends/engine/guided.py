"""Structured outputs: grammar-constrained decoding, on llguidance.

A request may carry a ``GuidedSpec`` (``SamplingParams.guided``): a JSON object,
a JSON Schema, a regular expression, or a choice among strings. The engine
compiles it once per distinct spec (``grammar_compiler.GrammarCompiler``, under a
budget, cached), and every sequence of the request gets a ``Guide`` of
its own: an llguidance matcher that has consumed the sequence's output so far.
Each step the sampler asks every guided sequence's matcher for the set of
tokens the grammar allows next (a bitmask, one bit per token; ``fill_masks``)
and gives every other token -inf (``apply_bitmask``) before sampling, so a
guided output can only ever be a prefix of a string of the grammar. EOS is in
the set only where the grammar accepts what came so far; once the grammar is
complete it is the only token left. A mask over llguidance's per-step limits
(``grammar_sandbox.PARSER_LIMITS``) leaves the matcher in its error state:
``fill_masks`` notes it on the guide (``Guide.error``) and the engine ends that
sequence with an error instead of the EOS the mask then allows.

Why llguidance rather than xgrammar: ``benchmarks/bench_grammar.py`` on this
model's vocabulary (docs/benchmarks.md). It has a numpy interface (the engine
imports no tensor library; xgrammar imports torch), needs no dependency of its
own, and compiled a nested schema in about a millisecond.

The matcher's state is a function of the sequence's output tokens and nothing
else: it advances when the engine appends a token (``LLMEngine._push``) and
never otherwise. Preemption keeps a sequence's output (by recompute its KV is
prefilled again, by swap it is copied back), so the matcher is right as it is
and nothing is replayed. A speculative draft never enters it: the masks of the
draft's rows are computed by advancing a matcher through the draft and rolling
it back in one call (``fill_masks``), and only the tokens verification keeps
are appended, and consumed, afterwards.

JSON is compact (no whitespace between tokens): free whitespace would let a
model pad an answer until ``max_tokens`` without ever finishing it. A
``json_object`` answer always parses, even where ``max_tokens`` would cut it:
its guide tracks the shortest text that closes the object (``json_closer.JsonCloser``) and,
as the budget runs out, first allows only tokens short enough to leave room to
close, then writes the closing bytes itself (``Guide.limit``); such an answer
ends with finish reason "length". A schema's answer has no such guarantee (its
shortest completion depends on the schema): bounded schemas with ``max_tokens``
above their longest answer always complete.
llguidance is imported on first use, so loading the engine does not load it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import SamplingParamsError
from .json_closer import JSON_CLOSE_GROWTH, JsonCloser

log = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema", "regex", "choice")
MAX_CHOICES = 256  # guided choice: more alternatives than this are a grammar, not a choice
# JSON as the engine emits it: compact, so a model cannot pad an answer with whitespace.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GuidedSpec:
    """What a request's output must match.

    ``kind`` "json_object": any JSON object; "json_schema": a JSON value valid
    against ``schema`` (a JSON Schema, a dict); "regex": a full match of
    ``pattern`` (Rust regex syntax: no look-around, no back-references);
    "choice": exactly one of ``choices``.
    """

    kind: str
    schema: Any = None
    pattern: str | None = None
    choices: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if isinstance(self.choices, list):
            object.__setattr__(self, "choices", tuple(self.choices))

    def validate(self) -> None:
        """Raise ``SamplingParamsError`` (param ``guided``) for a spec of the wrong shape."""
        if self.kind not in KINDS:
            raise _error(f"guided kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "json_schema":
            if not isinstance(self.schema, dict):
                raise _error("a JSON schema must be a JSON object")
            try:
                json.dumps(self.schema, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise _error(f"the JSON schema is not JSON: {exc}") from None
        elif self.kind == "regex":
            if not isinstance(self.pattern, str) or not self.pattern:
                raise _error("a guided regex must be a non-empty string")
        elif self.kind == "choice":
            choices = self.choices
            if not isinstance(choices, tuple) or not choices or len(choices) > MAX_CHOICES:
                raise _error(f"a guided choice needs 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in choices):
                raise _error("every guided choice must be a non-empty string")

    def key(self) -> str:
        """The cache key: the same spec, however its dict was ordered, is one key."""
        return json.dumps([self.kind, self.schema, self.pattern, list(self.choices)], sort_keys=True,
                          separators=(",", ":"))  # fmt: skip

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this spec."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.schema, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.pattern or "")
        # Lark string literals take JSON's escapes, so each choice is matched as written.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choices))


def _error(message: str) -> SamplingParamsError:
    return SamplingParamsError("guided", message)


def first_line(message: str) -> str:
    """llguidance's reason, without the parser state and grammar it appends to some errors."""
    head = message.split("\n<state>", 1)[0].strip()
    return head if len(head) <= 1000 else head[:1000] + "..."


class Guide:
    """One sequence's matcher: the grammar's state after the sequence's output so far; for a
    ``json_object``, also what closes the object (``closer``) and the budget rule (``limit``)."""

    __slots__ = ("matcher", "closer", "vocabulary", "closed_early", "error", "grammar_key")

    def __init__(self, matcher: Any, closer: JsonCloser | None = None, vocabulary: TokenBytes | None = None,
                 grammar_key: str | None = None) -> None:  # fmt: skip
        self.matcher = matcher
        self.closer = closer
        self.vocabulary = vocabulary
        self.closed_early = False  # limit() wrote closing bytes: the answer was cut, and closed
        # Why the matcher stopped: a mask over llguidance's limits (set by fill_masks); the sequence ends.
        self.error: str | None = None
        self.grammar_key = grammar_key  # its compiled grammar's cache key, to drop a grammar that failed

    def consume(self, token_id: int) -> bool:
        """Advance past ``token_id``; False where the grammar did not allow it (the matcher
        then only allows EOS: a sequence that took an EOS the grammar had already ended
        with, under ``ignore_eos``, goes on with EOS until its length)."""
        if self.closer is not None and self.vocabulary is not None:
            self.closer.feed(self.vocabulary.text[token_id])
        return bool(self.matcher.consume_token(token_id))

    @property
    def is_accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    def limit(self, row: np.ndarray, remaining: int) -> None:
        """Keep room to close the object within ``remaining`` tokens (EOS included), editing a
        masked logits row in place. The invariant, true at the start whenever ``max_tokens``
        is at least 3: ``remaining >= len(closing text) + 1``. A token of ``n`` bytes makes the
        closing text at most ``JSON_CLOSE_GROWTH * n`` longer, so while that fits only tokens
        of at most ``n`` bytes stay; when nothing does, the next closing byte is the only
        choice (each such byte is a token of a byte-level vocabulary)."""
        if self.closer is None or self.vocabulary is None:
            return
        closing = self.closer.closing()
        if not closing:
            return  # complete: the grammar allows only EOS
        slack = remaining - 2 - len(closing)
        if slack >= JSON_CLOSE_GROWTH * self.vocabulary.max_len:
            return  # far from the budget: every token fits
        longest = slack // JSON_CLOSE_GROWTH
        if longest >= 1:
            short = np.where(self.vocabulary.lengths > longest, np.float32(-np.inf), row)
            if np.isfinite(short.max()):
                row[:] = short
                return
            # Everything the mask allows is too long. (Where the grammar forces text, as "alse"
            # after "f", llguidance's mask offers only its canonical token, though the matcher
            # takes the same bytes one token at a time.)
        token = self.vocabulary.byte_token.get(closing[0])
        if token is None:
            return  # no token for that byte: leave the row to the grammar
        # The closing byte, whatever the mask says: the matcher takes it (a valid JSON ending).
        row[:] = -np.inf
        row[token] = 0.0
        self.closed_early = True


class TokenBytes:
    """Each token's bytes, their lengths (0 for special tokens, which the grammar only ever
    allows as EOS), and the token of each single byte."""

    __slots__ = ("text", "lengths", "max_len", "byte_token")

    def __init__(self, ll_tokenizer: Any, vocab_size: int) -> None:
        specials = [ll_tokenizer.is_special_token(i) for i in range(vocab_size)]
        self.text = [b"" if special else ll_tokenizer.decode_bytes([i]) for i, special in enumerate(specials)]
        self.lengths = np.fromiter((len(t) for t in self.text), dtype=np.int32, count=vocab_size)
        self.max_len = int(self.lengths.max())
        self.byte_token: dict[int, int] = {}
        for i, text in enumerate(self.text):
            if len(text) == 1:
                self.byte_token.setdefault(text[0], i)


# -- masks -----------------------------------------------------------------------

_executor: Any = None
_executor_lock = threading.Lock()


def _get_executor() -> Any:
    global _executor
    with _executor_lock:
        if _executor is None:
            from llguidance import LLExecutor

            _executor = LLExecutor()
        return _executor


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_masks(rows: Seq[tuple[Guide, int]], drafted: Seq[tuple[Guide, int, Seq[int]]], bitmask: np.ndarray) -> None:
    """Fill ``bitmask`` ([rows, words] int32, C-contiguous): row ``i`` of each ``(guide, i)``
    with what its grammar allows next; for each ``(guide, i, draft)``, rows ``i`` to
    ``i + len(draft)`` with what it allows after each prefix of ``draft`` (none of the draft
    stays consumed; rows after a token the grammar refuses allow nothing). One call into
    llguidance each, the GIL released. A guide whose matcher failed gets its ``error``."""
    import llguidance.numpy as lln

    executor = _get_executor()
    if rows:
        lln.fill_next_token_bitmask_par(executor, [(g.matcher, i) for g, i in rows], bitmask)
    if drafted:
        lln.fill_next_token_bitmask_par_with_draft_tokens(
            executor, [(g.matcher, i, list(d)) for g, i, d in drafted], bitmask
        )
    for guide in [g for g, _ in rows] + [g for g, _, _ in drafted]:
        # Over a step's limits the matcher is in its error state and its mask allows only EOS: an
        # answer cut short that would look finished. The engine ends the sequence with this instead.
        if guide.error is None and guide.matcher.is_error():
            guide.error = first_line(guide.matcher.get_error())


def _allowed(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bitmask.view(np.uint8), axis=-1, count=vocab, bitorder="little").view(bool)


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """``logits`` ([n, vocab] float32, or one row) with every token its row of ``bitmask`` leaves
    out at -inf: a new array (one vectorised select, cheaper than masking in place)."""
    return np.where(_allowed(bitmask, logits.shape[-1]), logits, np.float32(-np.inf))


def mask_rows(logits: np.ndarray, rows: Seq[int], bitmask: np.ndarray) -> None:
    """``apply_bitmask`` in place, on rows ``rows`` of ``logits`` (row ``rows[j]`` by ``bitmask[j]``)."""
    refused = np.logical_not(_allowed(bitmask, logits.shape[-1]))
    for j, i in enumerate(rows):
        np.copyto(logits[i], np.float32(-np.inf), where=refused[j])
