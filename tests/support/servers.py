"""Serving an ASGI app over a real loopback socket from a test."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any


def free_loopback_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def start_uvicorn(app: Any, sock: socket.socket | None = None) -> tuple[Any, threading.Thread, socket.socket, str]:
    """Serve ``app`` on ``sock`` (default: a free loopback port) in a thread; returns (server, thread, socket, url)."""
    import uvicorn

    sock = sock or free_loopback_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **_gateway_options(app)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="live-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the live server did not start")
        time.sleep(0.02)
    return server, thread, sock, f"http://127.0.0.1:{port}"


def _gateway_options(app: Any) -> dict[str, Any]:
    """A gateway app is served as ``inferctl serve`` serves it (its slow-client deadlines); other apps as they are."""
    settings = getattr(getattr(app, "state", None), "settings", None)
    if settings is None:
        return {}
    from inferflux.gateway.slowclients import server_options

    return server_options(settings.input_limits, settings.server.stream_write_timeout_seconds, settings.websocket)


def stop_uvicorn(server: Any, thread: threading.Thread, sock: socket.socket) -> None:
    server.should_exit = True
    thread.join(timeout=15)
    sock.close()
