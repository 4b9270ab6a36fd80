"""An engine's grammars: each ``GuidedSpec`` compiled once, under a budget, and kept in a cache bounded by bytes.

A spec the engine has not compiled yet is first built, and its first mask
computed, in a grammar worker under a ``GrammarBudget`` (``grammar_sandbox``):
over its CPU time, wall time or memory it is refused (``GrammarTooComplexError``),
and nothing of it ran in this process. What passes is built again here, with
the same llguidance limits (``grammar_sandbox.PARSER_LIMITS``, which also bound
every mask while decoding), and cached.

The cache keeps at most ``cache_size`` grammars and ``cache_bytes`` bytes, least
recently used first out. A grammar's weight is what building it and its first mask
grew the worker's resident memory by, plus the spec it keeps (twice its canonical
JSON) and ``ENTRY_BYTES``; a grammar heavier than the whole cache is used by its
request and not kept. A grammar's lexer is shared by every sequence decoding under
it and grows as their masks are computed, up to the limits' ``max_lexer_states``:
that growth comes after the weight was taken. A grammar whose mask failed while
decoding (the lexer full, a step over its limits) is dropped, so the next request
gets a fresh one.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from .errors import SamplingParamsError
from .grammar_sandbox import DEFAULT_BUDGET, PARSER_LIMITS, GrammarBudget, GrammarSandbox, Vocabulary, shared_sandbox
from .guided import Guide, GuidedSpec, TokenBytes, first_line
from .json_closer import JsonCloser

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept per engine
DEFAULT_CACHE_BYTES = 256 << 20
ENTRY_BYTES = 4096  # a cached grammar's own Python objects, beside what the worker measured


class CompiledGrammar:
    """A spec compiled for one vocabulary: a matcher at the start that is copied, never advanced."""

    __slots__ = ("spec", "key", "_template", "_vocabulary")

    def __init__(self, spec: GuidedSpec, template: Any, vocabulary: TokenBytes | None = None, key: str = "") -> None:
        self.spec = spec
        self.key = key  # its cache key
        self._template = template
        self._vocabulary = vocabulary  # json_object: the guide closes the object as the budget runs out

    def guide(self) -> Guide:
        if self._vocabulary is None:
            return Guide(self._template.deep_copy(), grammar_key=self.key)
        return Guide(self._template.deep_copy(), JsonCloser(), self._vocabulary, grammar_key=self.key)


class GrammarCompiler:
    """An engine's grammars: the vocabulary as llguidance sees it, built on first use, and
    a cache of compiled grammars bounded in count and bytes. Thread-safe (``make_request`` runs anywhere)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, cache_bytes: int = DEFAULT_CACHE_BYTES, *,
                 sandbox: GrammarSandbox | None = None, limits: dict[str, Any] | None = None) -> None:  # fmt: skip
        """``sandbox``: where new grammars are checked (default: the process's); ``limits``: llguidance's
        ``LLParserLimits`` for the compile and every mask (default ``PARSER_LIMITS``)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.sandbox = sandbox if sandbox is not None else shared_sandbox()
        self.limits = dict(PARSER_LIMITS if limits is None else limits)
        self._cache: OrderedDict[str, tuple[CompiledGrammar, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_bytes_used = 0
        self.num_compiled = 0  # cache misses, for tests and stats

    def compile(self, spec: GuidedSpec, budget: GrammarBudget = DEFAULT_BUDGET,
                cancel: threading.Event | None = None, owner: str | None = None) -> CompiledGrammar:  # fmt: skip
        """The compiled grammar of ``spec``; raises ``SamplingParamsError`` (param ``guided``)
        naming what the grammar engine cannot do (``Unimplemented keys: ["if"]``, a regex
        with look-ahead, a ``$ref`` to another document, ...), ``GrammarTooComplexError`` for
        a grammar over ``budget``, and what ``GrammarSandbox.check`` raises (busy, cancelled;
        ``owner``, whose grammar it is, shares its workers fairly)."""
        spec.validate()
        key = hashlib.sha256(spec.key().encode("utf-8", "surrogatepass")).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit[0]
        from llguidance import LLMatcher, LLParserLimits

        try:
            grammar = spec.grammar()
        except ValueError as exc:  # not an object schema, options that do not apply
            raise _error(f"the grammar cannot be compiled: {exc}") from None
        verdict = self.sandbox.check(grammar, self._shared(_sandbox_vocabulary), budget, cancel, self.limits, owner)
        if verdict.error:
            raise _error(f"the grammar cannot be compiled: {first_line(verdict.error)}")
        template = LLMatcher(self._vocabulary(), grammar, log_level=0, limits=LLParserLimits(**self.limits))
        if template.is_error():
            raise _error(f"the grammar cannot be compiled: {first_line(template.get_error())}")
        compiled = CompiledGrammar(spec, template, self._token_bytes() if spec.kind == "json_object" else None, key)
        weight = verdict.bytes + 2 * len(spec.key()) + ENTRY_BYTES
        with self._lock:
            self.num_compiled += 1
            if weight <= self.cache_bytes and key not in self._cache:
                self._cache[key] = (compiled, weight)
                self.cache_bytes_used += weight
                while len(self._cache) > self.cache_size or self.cache_bytes_used > self.cache_bytes:
                    self.cache_bytes_used -= self._cache.popitem(last=False)[1][1]
        return compiled

    def forget(self, key: str | None) -> None:
        """Drop a cached grammar (one whose mask failed while decoding: its lexer may be full)."""
        with self._lock:
            entry = self._cache.pop(key, None) if key is not None else None
            if entry is not None:
                self.cache_bytes_used -= entry[1]

    @property
    def cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def _token_bytes(self) -> TokenBytes:
        return self._shared(lambda tokenizer, vocab_size, eos: TokenBytes(self._vocabulary(), vocab_size), "bytes")

    def _vocabulary(self) -> Any:
        return self._shared(_ll_tokenizer)

    def _shared(self, build: Callable[[Any, int, tuple[int, ...]], Any], kind: str | None = None) -> Any:
        """What ``build`` makes of the tokenizer, shared by the engines over one tokenizer object."""
        return _shared_by_tokenizer(self._tokenizer, (kind or build.__name__, self.vocab_size,
                                                      tuple(self.eos_token_ids)), build)  # fmt: skip


def _error(message: str) -> SamplingParamsError:
    return SamplingParamsError("guided", message)


# Building llguidance's vocabulary costs about half a second: engines over one tokenizer object
# (a model's draft, tests' many engines) share it, for as long as the tokenizer lives.
_by_tokenizer: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()
_by_tokenizer_lock = threading.RLock()  # a build may ask for another (the token bytes need the vocabulary)


def _shared_by_tokenizer(tokenizer: Any, key: tuple[Any, ...], build: Callable[[Any, int, tuple[int, ...]], Any]) -> Any:
    with _by_tokenizer_lock:
        try:
            built = _by_tokenizer.setdefault(tokenizer, {})
        except TypeError:  # not weakly referenceable: built for each caller
            built = {}
        if key not in built:
            built[key] = build(tokenizer, key[1], key[2])
        return built[key]


def _tokenizer_json(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend", None)
    to_str = getattr(backend, "to_str", None)
    if to_str is None:
        raise _error("this model's tokenizer cannot drive structured outputs (it has no tokenizers pipeline)")
    text: str = to_str()
    return text


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """llguidance's view of ``tokenizer``: from its ``tokenizers`` pipeline (a model's
    ``backends.models.Tokenizer`` has one, whether it came from a GGUF or a directory)."""
    from llguidance import LLTokenizer

    return LLTokenizer(_tokenizer_json(tokenizer), n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)


def _sandbox_vocabulary(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Vocabulary:
    """The same vocabulary as a grammar worker builds it."""
    return Vocabulary.of(_tokenizer_json(tokenizer), vocab_size, eos_token_ids)
