"""``RemoteRequest``: one choice of a generation, as an upstream server is asked for it.

The gateway builds it (``gateway.pipeline.plan``): the OpenAI request body the upstream
receives, already in the upstream's model name and with ``n`` 1, plus what the
policy chain needs before the upstream says anything (an estimate of the
prompt's tokens, the completion's bound). The remote engine trusts it as it is,
as the local engine trusts an ``EngineRequest``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from inferflux.backends.engine import SamplingParams


def estimate_tokens(text: str) -> int:
    """Tokens a text is charged before (or without) the upstream's count: about four characters a token.
    Here, not in engine.py, so the gateway's pipeline can charge it without importing the fleet's HTTP client."""
    return max(1, math.ceil(len(text) / 4)) if text else 0


@dataclass(frozen=True, slots=True)
class RemoteRequest:
    request_id: str
    route: Literal["chat", "completion"]
    body: Mapping[str, Any]  # the upstream's request body; "stream" is set by the engine
    prompt_tokens: int  # an estimate until the upstream reports its own count
    params: SamplingParams  # what the plan checked; ``params.max_tokens`` bounds the completion
    affinity: bytes | None = None  # equal keys go to the same endpoint (its prefix cache)
    headers: Mapping[str, str] = field(default_factory=dict)  # the allow-listed client headers (traceparent)
    tenant: str | None = None
    # The client reads a stream: so is the upstream asked. False: one unstreamed answer, given whole.
    stream: bool = True

    @property
    def prompt(self) -> range:
        """Stands in for the token list the plan counts (``len`` is the estimate)."""
        return range(self.prompt_tokens)


@dataclass(frozen=True, slots=True)
class RemoteEmbeddingRequest:
    """One embeddings request as an upstream server is asked for it (``POST {base}/embeddings``).

    ``body`` is in the upstream's model name, with the inputs as the client
    sent them (after the input guardrails) and ``encoding_format`` float; the
    gateway encodes the answer itself. ``prompt_tokens`` is the gateway's
    estimate, settled with the upstream's ``usage``.
    """

    request_id: str
    body: Mapping[str, Any]
    num_inputs: int
    prompt_tokens: int
    headers: Mapping[str, str] = field(default_factory=dict)  # the allow-listed client headers (traceparent)
    tenant: str | None = None
