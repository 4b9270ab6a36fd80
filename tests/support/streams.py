"""Streaming a completion over a real socket and noting when its first token arrived."""

from __future__ import annotations

import time

import httpx

from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from http_helpers import bearer

SEATS = 4  # the small-batch engine's max_num_seqs (tests/gateway/conftest.py): a flood of a few dozen streams queues


async def first_token_at(client: httpx.AsyncClient, key: str, max_tokens: int, stamps: dict[str, float],
                         name: str) -> None:  # fmt: skip
    """Stream a completion named ``name``; ``stamps[name]`` is when its first token arrived."""
    body = {"model": DEFAULT_MODEL_NAME, "prompt": f"Write about {name}.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body, headers=bearer(key)) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and name not in stamps:
                stamps[name] = time.monotonic()
