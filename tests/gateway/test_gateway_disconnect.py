"""A client that goes away mid-request stops its generation and frees its KV blocks."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

from inferflux.gateway.models.served import ServedModel

MODEL = "smollm2-135m-instruct"


def wait_until_idle(served: ServedModel, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = served.engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_blocks_used == 0:
            assert stats.num_blocks_free == stats.num_blocks_total
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy after the client left: {stats}")
        time.sleep(0.05)


def _post(live_server: str, path: str, body: dict[str, object], key: str) -> socket.socket:
    url = urlsplit(live_server)
    sock = socket.create_connection((url.hostname, url.port), timeout=60)
    payload = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def _read_until(sock: socket.socket, marker: bytes, limit: int = 1 << 20) -> bytes:
    data = b""
    while marker not in data:
        chunk = sock.recv(4096)
        if not chunk or len(data) > limit:
            raise AssertionError(f"connection ended before {marker!r}: {data[-500:]!r}")
        data += chunk
    return data


def test_stream_disconnect_aborts_generation(live_server: str, served_model: ServedModel, admin_key: str) -> None:
    wait_until_idle(served_model)
    generated_before = served_model.engine.stats().num_tokens_generated
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    sock = _post(live_server, "/v1/chat/completions", body, admin_key)
    try:
        head = _read_until(sock, b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        # The role chunk and then two content chunks: generation is under way.
        data = head
        while data.count(b"data: ") < 3:
            data += _read_until(sock, b"\n\n")
        assert served_model.engine.stats().num_running + served_model.engine.stats().num_waiting >= 1
    finally:
        sock.close()
    wait_until_idle(served_model)
    # Far fewer than the 1000 tokens asked for were generated (the 64 MiB test
    # cache holds about 1400 tokens, so the request fits).
    assert served_model.engine.stats().num_tokens_generated - generated_before < 500


def test_non_stream_disconnect_aborts_generation(
    live_server: str, served_model: ServedModel, admin_key: str
) -> None:
    wait_until_idle(served_model)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
    sock = _post(live_server, "/v1/completions", body, admin_key)
    try:
        deadline = time.monotonic() + 20
        while served_model.engine.stats().num_running == 0:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.02)
    finally:
        sock.close()
    wait_until_idle(served_model)
