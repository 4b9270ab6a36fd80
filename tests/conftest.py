"""Shared fixtures: the real default model on the CPU backend, a policy store, and a live gateway."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
def gateway_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The data directory of the session's gateway (SQLite store and its key file)."""
    return tmp_path_factory.mktemp("gateway-data")


@pytest.fixture(scope="session")
def gateway_store(gateway_data_dir: Path) -> Iterator[Any]:
    """The session's policy store (SQLite under ``gateway_data_dir``), bootstrapped."""
    from gateway.settings import Settings
    from policy.store import PolicyStore

    settings = Settings(data_dir=gateway_data_dir)
    store = PolicyStore.open(settings.store, settings.data_dir)
    yield store
    store.close()


@pytest.fixture(scope="session")
def admin_key(gateway_store: Any) -> str:
    """A platform-admin API key of ``gateway_store``: the bootstrap key printed on first start."""
    key = gateway_store.ensure_bootstrap_admin()
    assert key is not None, "the session store was bootstrapped twice"
    return str(key)


@pytest.fixture(scope="session")
def auth_headers(admin_key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {admin_key}"}


def build_app(served_model: Any, store: Any, **settings: Any) -> Any:
    """An app serving the session model from ``store``; the engine stays the session's."""
    from gateway.app import create_app
    from gateway.models import ModelManager
    from gateway.settings import Settings

    manager = ModelManager(expected=[served_model.name])
    manager.add(served_model)
    return create_app(Settings(**settings), manager, store=store, owns_models=False)


def start_uvicorn(app: Any) -> tuple[Any, threading.Thread, socket.socket, str]:
    """Serve ``app`` on a free loopback port in a thread; returns (server, thread, socket, url)."""
    import uvicorn

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
    return server, thread, sock, f"http://127.0.0.1:{port}"


def stop_uvicorn(server: Any, thread: threading.Thread, sock: socket.socket) -> None:
    server.should_exit = True
    thread.join(timeout=15)
    sock.close()


@pytest.fixture(scope="session")
def live_server(served_model: object, gateway_store: Any, admin_key: str) -> Iterator[str]:
    """The gateway serving ``served_model`` over a real socket; yields its base URL.

    Every route but the probes needs credentials: use ``admin_key`` / ``auth_headers``.
    """
    server, thread, sock, url = start_uvicorn(build_app(served_model, gateway_store))
    try:
        yield url
    finally:
        stop_uvicorn(server, thread, sock)
