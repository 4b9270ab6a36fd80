"""The ``openai`` backend plugin: models served by remote OpenAI-compatible servers.

Registered under ``inferflux.backends`` like the engine backends and listed
with them (``inferctl backends``), but of the other kind: it never runs
``forward``; ``open`` gives the served model's ``RemoteEngine`` over a
``Fleet`` of endpoints. It imports no tensor library and runs anywhere.
"""

from __future__ import annotations

from typing import ClassVar

from inferflux.backends.openai.engine import RemoteEngine
from inferflux.backends.openai.fleet import FleetConfig


class OpenAIBackend:
    name: ClassVar[str] = "openai"
    kind: ClassVar[str] = "remote"

    @classmethod
    def probe(cls) -> str | None:
        return None  # only aiohttp, a dependency of the gateway

    def open(self, config: FleetConfig, *, upstream_model: str, max_model_len: int = 0) -> RemoteEngine:
        return RemoteEngine(config, upstream_model=upstream_model, max_model_len=max_model_len)
