"""Preemption by swap through the API: a model with too little KV memory for its
concurrent requests parks KV on disk, answers every request as it would alone,
and shows the swapping in its metrics."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from starlette.testclient import TestClient

# ``swapping_model`` loads the default model (the tiers: tests/conftest.py).
pytestmark = pytest.mark.model

PROMPTS = [
    "List five colours of the rainbow:",
    "Write the numbers from one to ten in words:",
    "Name three planets of the solar system:",
    "The days of the week are",
]


@pytest.fixture(scope="module")
def swapping_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The default model in float32 with 8 KV blocks of 16 tokens: room for two or three of the requests at once."""
    from inferflux.backends.base import ModelSpec
    from inferflux.backends.engine import EngineConfig
    from inferflux.backends.models import default_model_path

    from inferflux.gateway.models.served import load_served_model

    swap_dir = tmp_path_factory.mktemp("swap")
    spec = ModelSpec(name="smollm2-swap", path=default_model_path(), dtype="float32")
    config = EngineConfig(block_size=16, num_blocks=8, preemption_mode="swap", swap_dir=str(swap_dir))
    model = load_served_model(spec, "cpu", config)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def client(swapping_model: Any, gateway_store: Any) -> Iterator[TestClient]:
    import tempfile

    from inferflux.gateway.app import create_app
    from inferflux.gateway.models.served import ModelManager
    from inferflux.gateway.settings import Settings

    manager = ModelManager(expected=[swapping_model.name])
    manager.add(swapping_model)
    app = create_app(Settings(data_dir=tempfile.mkdtemp(prefix="inferflux-app-")), manager, store=gateway_store,
                     owns_models=False)  # fmt: skip
    with TestClient(app) as test_client:
        yield test_client


def complete(client: TestClient, headers: dict[str, str], prompt: str) -> str:
    body = {"model": "smollm2-swap", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def metric(client: TestClient, headers: dict[str, str], name: str) -> float:
    text = client.get("/metrics", headers=headers).text
    match = re.search(rf'^{name}{{model="smollm2-swap"}} (\S+)$', text, re.M)
    assert match, f"{name} missing"
    return float(match.group(1))


def test_concurrent_requests_that_exhaust_kv_memory_swap_and_answer_as_alone(
    client: TestClient, auth_headers: dict[str, str], swapping_model: Any
) -> None:
    alone = [complete(client, auth_headers, p) for p in PROMPTS]
    assert metric(client, auth_headers, "inferflux_kv_swap_out_blocks_total") == 0  # one at a time fits
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: complete(client, auth_headers, p), PROMPTS))
    assert together == alone
    swapped_out = metric(client, auth_headers, "inferflux_kv_swap_out_blocks_total")
    assert swapped_out > 0
    assert metric(client, auth_headers, "inferflux_kv_swap_in_blocks_total") == swapped_out
    assert metric(client, auth_headers, "inferflux_engine_swapped_sequences") == 0
    assert metric(client, auth_headers, "inferflux_engine_preemptions_total") > 0
