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
cache may be smaller (``LLMEngine.add`` checks only that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
