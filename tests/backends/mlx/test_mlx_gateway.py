"""``inferctl serve --backend mlx``: the gateway loads the default model on the MLX
backend through the same path as the command (gateway.models.served.load_served_model, the
registry's entry point) and answers /v1/completions with the CPU backend's greedy text."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from inferflux.backends.base import ModelSpec
from inferflux.backends.engine import EngineConfig, LLMEngine, SamplingParams
from inferflux.backends.models import default_model_path
from inferflux.gateway.app import create_app
from inferflux.gateway.models.served import ModelManager, load_served_model
from inferflux.gateway.settings import DEFAULT_MODEL_NAME, Settings
from http_helpers import bearer

# Skipped, saying why, only where mlx is absent (it is a dev dependency on Linux and macOS).
pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'inferflux[mlx]')")

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def mlx_served() -> Iterator[Any]:
    spec = ModelSpec(name=DEFAULT_MODEL_NAME, path=default_model_path(), dtype="float32")
    model = load_served_model(spec, "mlx", EngineConfig(num_blocks=32))
    yield model
    model.shutdown()


def _cpu_greedy_text(cpu_loaded: tuple[Any, Any], tokenizer: Any) -> str:
    """What the completions route asks of the engine, on the CPU backend."""
    backend, info = cpu_loaded
    engine = LLMEngine(backend, tokenizer, info, EngineConfig(num_blocks=32))
    engine.add_request("cpu", tokenizer.encode(PROMPT), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    text = ""
    while engine.has_unfinished_requests():
        text += "".join(out.new_text for out in engine.step())
    return text


def test_served_on_mlx_completes_like_cpu(mlx_served, gateway_store, admin_key, cpu_loaded, smol_tokenizer,
                                         tmp_path):
    assert mlx_served.backend == "mlx" and mlx_served.info.dtype == "float32"
    manager = ModelManager(expected=[mlx_served.name])
    manager.add(mlx_served)
    app = create_app(Settings(data_dir=str(tmp_path)), manager, store=gateway_store, owns_models=False)
    with TestClient(app) as client:
        response = client.post(
            "/v1/completions",
            json={"model": DEFAULT_MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
            headers=bearer(admin_key),
        )
        streamed = _streamed_text(client, admin_key)
        chat = client.post(
            "/v1/chat/completions",
            json={"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "Say hello."}],
                  "max_tokens": MAX_TOKENS, "temperature": 0},
            headers=bearer(admin_key),
        )  # fmt: skip
        models = client.get("/v1/models", headers=bearer(admin_key))
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["text"] == _cpu_greedy_text(cpu_loaded, smol_tokenizer)
    assert choice["text"].strip()
    assert streamed == choice["text"]  # SSE chunks add up to the same greedy text
    assert chat.status_code == 200, chat.text
    message = chat.json()["choices"][0]
    assert message["message"]["role"] == "assistant" and message["message"]["content"].strip()
    assert chat.json()["usage"]["completion_tokens"] <= MAX_TOKENS
    assert models.status_code == 200 and DEFAULT_MODEL_NAME in [m["id"] for m in models.json()["data"]]


def _streamed_text(client: TestClient, admin_key: str) -> str:
    import json

    body = {"model": DEFAULT_MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text = ""
    with client.stream("POST", "/v1/completions", json=body, headers=bearer(admin_key)) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text
