"""Structured outputs: grammar-constrained decoding, on llguidance.

A request may carry a ``GuidedSpec`` (``SamplingParams.guided``): a JSON object,
a JSON Schema, a regular expression, or a choice among strings. The engine
compiles it once per distinct spec (``GrammarCompiler``, a cache keyed by the
spec's canonical JSON), and every sequence of the request gets a ``Guide`` of
its own: an llguidance matcher that has consumed the sequence's output so far.
Each step the sampler asks every guided sequence's matcher for the set of
tokens the grammar allows next (a bitmask, one bit per token; ``fill_masks``)
and gives every other token -inf (``apply_bitmask``) before sampling, so a
guided output can only ever be a prefix of a string of the grammar. EOS is in
the set only where the grammar accepts what came so far; once the grammar is
complete it is the only token left.

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
model pad an answer until ``max_tokens`` without ever finishing it.
llguidance is imported on first use, so loading the engine does not load it.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import SamplingParamsError

log = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema", "regex", "choice")
MAX_CHOICES = 256  # guided choice: more alternatives than this are a grammar, not a choice
DEFAULT_CACHE_SIZE = 256  # compiled grammars kept per engine
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


class Guide:
    """One sequence's matcher: the grammar's state after the sequence's output so far."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def consume(self, token_id: int) -> bool:
        """Advance past ``token_id``; False where the grammar did not allow it (the matcher
        then only allows EOS: a sequence that took an EOS the grammar had already ended
        with, under ``ignore_eos``, goes on with EOS until its length)."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def is_accepting(self) -> bool:
        return bool(self.matcher.is_accepting())


class CompiledGrammar:
    """A spec compiled for one vocabulary: a matcher at the start that is copied, never advanced."""

    __slots__ = ("spec", "_template")

    def __init__(self, spec: GuidedSpec, template: Any) -> None:
        self.spec = spec
        self._template = template

    def guide(self) -> Guide:
        return Guide(self._template.deep_copy())


class GrammarCompiler:
    """An engine's grammars: the vocabulary as llguidance sees it, built on first use, and
    a bounded cache of compiled grammars. Thread-safe (``make_request`` runs anywhere)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:  # fmt: skip
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self.cache_size = cache_size
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and stats

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec``; raises ``SamplingParamsError`` (param ``guided``)
        naming what the grammar engine cannot do (``Unimplemented keys: ["if"]``, a regex
        with look-ahead, a ``$ref`` to another document, ...)."""
        spec.validate()
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        from llguidance import LLMatcher

        try:
            grammar = spec.grammar()
        except ValueError as exc:  # not an object schema, options that do not apply
            raise _error(f"the grammar cannot be compiled: {exc}") from None
        template = LLMatcher(self._vocabulary(), grammar, log_level=0)
        if template.is_error():
            raise _error(f"the grammar cannot be compiled: {_first_line(template.get_error())}")
        compiled = CompiledGrammar(spec, template)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _vocabulary(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _ll_tokenizer(self._tokenizer, self.vocab_size, tuple(self.eos_token_ids))
            return self._ll_tokenizer


# Building llguidance's vocabulary costs about half a second: engines over one tokenizer object
# (a model's draft, tests' many engines) share it, for as long as the tokenizer lives.
_vocabularies: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]] = weakref.WeakKeyDictionary()
_vocabularies_lock = threading.Lock()


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """llguidance's view of ``tokenizer``: from its ``tokenizers`` pipeline (a model's
    ``backends.models.Tokenizer`` has one, whether it came from a GGUF or a directory)."""
    from llguidance import LLTokenizer

    backend = getattr(tokenizer, "backend", None)
    to_str = getattr(backend, "to_str", None)
    if to_str is None:
        raise _error("this model's tokenizer cannot drive structured outputs (it has no tokenizers pipeline)")
    key = (vocab_size, eos_token_ids)
    with _vocabularies_lock:
        try:
            built = _vocabularies.setdefault(tokenizer, {})
        except TypeError:  # not weakly referenceable: build it for this engine alone
            built = {}
        if key not in built:
            built[key] = LLTokenizer(to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        return built[key]


def _first_line(message: str) -> str:
    # llguidance appends its parser state and the grammar to some errors; the client wants the reason.
    head = message.split("\n<state>", 1)[0].strip()
    return head if len(head) <= 1000 else head[:1000] + "..."


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
    llguidance each, the GIL released."""
    import llguidance.numpy as lln

    executor = _get_executor()
    if rows:
        lln.fill_next_token_bitmask_par(executor, [(g.matcher, i) for g, i in rows], bitmask)
    if drafted:
        lln.fill_next_token_bitmask_par_with_draft_tokens(
            executor, [(g.matcher, i, list(d)) for g, i, d in drafted], bitmask
        )


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
