"""Shared fixtures: the real default model on the CPU backend, and a live gateway."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

DEFAULT_TEST_KV_CACHE_BYTES = 64 * 1024 * 1024


@pytest.fixture(scope="session")
def served_model() -> Iterator[object]:
    """SmolLM2-135M-Instruct (the bundled default) on the cpu backend, float32, 64 MiB of KV."""
    from backends.base import ModelSpec
    from backends.engine import EngineConfig
    from backends.models import default_model_path

    from gateway.models import load_served_model
    from gateway.settings import DEFAULT_MODEL_NAME

    spec = ModelSpec(
        name=DEFAULT_MODEL_NAME,
        path=default_model_path(),
        dtype="float32",
        aliases=("smollm2",),
    )
    model = load_served_model(spec, "cpu", EngineConfig(kv_cache_bytes=DEFAULT_TEST_KV_CACHE_BYTES))
    yield model
    model.shutdown()


def _free_loopback_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture(scope="session")
def live_server(served_model: object) -> Iterator[str]:
    """The gateway serving ``served_model`` over a real socket; yields its base URL."""
    import uvicorn

    from gateway.app import create_app
    from gateway.models import ModelManager, ServedModel
    from gateway.settings import Settings

    assert isinstance(served_model, ServedModel)
    manager = ModelManager(expected=[served_model.name])
    manager.add(served_model)
    # The engine belongs to the session fixture, not to this app.
    app = create_app(Settings(), manager, owns_models=False)
    sock = _free_loopback_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="live-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the live server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
