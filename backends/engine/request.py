"""``EngineRequest``: a request the engine has checked, and trusts from then on.

A request is validated once, where it enters the engine's world:
``LLMEngine.make_request`` (``AsyncEngine.make_request`` from any thread)
checks the prompt, the sampling parameters, the scheduling fields and the fit
against the model's context and the KV cache, and returns this frozen record
with ``max_tokens`` resolved and its grammar compiled (``params.guided``, into
``grammar``: a ``guided.CompiledGrammar``, from which ``add`` gives each
sequence a matcher of its own). ``AsyncEngine.stream`` and ``LLMEngine.add``
take it as it is; the gateway builds its requests the same way, so it maps the
engine's own errors to API errors instead of checking the same rules again.

A record belongs to the engine that made it: another engine's context or
cache may be smaller (``LLMEngine.add`` checks only that). ``EngineRequestChecks``
holds ``make_request`` and its checks; ``LLMEngine`` inherits them.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .block_manager import blocks_for
from .errors import CacheCapacityError, EmptyPromptError, InvalidPromptError, InvalidRequestError, PromptTooLongError
from .grammar_compiler import GrammarCompiler
from .sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never None
    priority: int = 0  # lower is more important
    cache_salt: str | None = None  # the prefix-cache namespace (a tenant id, say)
    tenant: str | None = None  # the fair-share key (``Scheduler``)
    weight: float = 1.0  # that tenant's share relative to the others'
    engine_id: int = 0  # id() of the engine that checked it
    grammar: Any = None  # params.guided compiled for this engine's vocabulary (guided.CompiledGrammar)


class EngineRequestChecks:
    """``LLMEngine``'s request checks: it inherits them, and owns the attributes declared here."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    grammars: GrammarCompiler

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> EngineRequest:
        """Check a request against the model and the cache without queueing it.

        Returns the ``EngineRequest`` that ``add`` (and ``AsyncEngine.stream``)
        trust, with ``max_tokens`` resolved (``params.max_tokens=None`` becomes
        "until the context or the cache is full"). ``cache_salt``: the
        prefix-cache namespace of the request (a tenant id, say): it reuses
        cached KV only of requests with the same salt. ``tenant`` and
        ``weight``: whose request it is (any string; the scheduler only
        compares them) and that tenant's share of the batch relative to the
        others' (``Scheduler``, fair sharing). ``priority``: lower is more
        important. ``params.guided`` is compiled here (once per distinct spec:
        ``guided.GrammarCompiler`` caches them); a grammar the engine cannot
        compile is an ``InvalidRequestError`` with param ``guided`` naming the
        construct. Raises an ``InvalidRequestError`` subclass
        (``EmptyPromptError``, ``PromptTooLongError``, ``CacheCapacityError``,
        ``SamplingParamsError``, ...). Thread-safe.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", param="priority")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
            raise InvalidRequestError(f"weight must be a positive number, got {weight!r}", param="weight")
        for name, value in (("cache_salt", cache_salt), ("tenant", tenant)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a string or None, got {type(value).__name__}")
        prompt = self._checked_prompt(prompt_token_ids)
        max_tokens = self._fitted_max_tokens(len(prompt), params.max_tokens)
        grammar = None if params.guided is None else self.grammars.compile(params.guided)
        return EngineRequest(
            request_id, prompt, params, max_tokens, priority=priority, cache_salt=cache_salt, tenant=tenant,
            weight=float(weight), engine_id=id(self), grammar=grammar,
        )

    def _checked_prompt(self, prompt_token_ids: Iterable[int]) -> list[int]:
        try:
            prompt = [operator.index(t) for t in prompt_token_ids]
        except TypeError:
            raise InvalidPromptError("prompt token ids must be integers") from None
        if not prompt:
            raise EmptyPromptError()
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidPromptError(f"prompt token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        return prompt

    def _fitted_max_tokens(self, n: int, requested: int | None) -> int:
        """``requested`` (or, for None, as many as fit), checked against the context and the KV cache."""
        if n >= self.max_model_len:  # the prompt alone leaves no room, whatever was asked for
            raise PromptTooLongError(n, None, self.max_model_len)
        if requested is None:
            # The last sampled token is never fed back, so n + max_tokens - 1
            # positions need KV.
            cache_tokens = self.num_blocks * self.block_size
            max_tokens = min(self.max_model_len - n, cache_tokens + 1 - n)
            if max_tokens < 1:
                raise CacheCapacityError(n, blocks_for(n, self.block_size), self.num_blocks, self.block_size)
        else:
            max_tokens = requested
            if n + max_tokens > self.max_model_len:
                raise PromptTooLongError(n, max_tokens, self.max_model_len)
        needed = n + max_tokens - 1
        if blocks_for(needed, self.block_size) > self.num_blocks:
            raise CacheCapacityError(needed, blocks_for(needed, self.block_size), self.num_blocks, self.block_size)
        return max_tokens
