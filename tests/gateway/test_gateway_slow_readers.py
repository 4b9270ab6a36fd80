"""A client that stops reading its stream is cut off: ``server.stream_write_timeout_seconds``.

Real sockets against a live server: each slow reader sends its request, reads
the response head and then nothing more, with a small receive buffer and the
maximum segment size of an ordinary network (on loopback the MSS is 64 KiB,
and the kernel would buffer megabytes for a client that reads nothing before
the server's writes wait). Once the server's writes have waited the deadline,
the connection is closed, the sequence aborted and its KV freed, and the
call's audit event says ``client_timeout``. A client that reads is not touched.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from admin_seed import seed_store
from http_helpers import bearer
from servers import start_uvicorn, stop_uvicorn

MODEL = "smollm2-135m-instruct"
DEADLINE = 1.0  # server.stream_write_timeout_seconds of the server under test
MAX_TOKENS = 500
pytestmark = pytest.mark.serial  # the engine's counters are read before and after: no other test beside it


def slow_reader(url: str, key: str, request_id: str) -> socket.socket:
    """A streamed chat whose client reads the response head and then nothing."""
    where = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1400)  # as over a network, not loopback's 64 KiB
    sock.settimeout(60)
    sock.connect((where.hostname, where.port))
    # Twenty alternatives a token: about 1.5 KB of stream per token, so the buffers fill in a few dozen tokens.
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell a very long story"}],
                       "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, "logprobs": True,
                       "top_logprobs": 20}).encode()  # fmt: skip
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nX-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)  # one byte at a time: nothing of the body is taken
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes the connection within ``timeout``, seen in the socket's TCP state
    (reading would take the stream and let the server write again)."""
    established = 1  # TCP_ESTABLISHED, the first byte of struct tcp_info
    return wait_for(lambda: sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] != established, timeout)


def engine_idle(served: Any) -> bool:
    stats = served.engine.stats()
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.num_blocks_used == 0


def wait_for(condition: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def spooled(spool: Path) -> list[dict[str, Any]]:
    return [json.loads(line)["event"] for segment in sorted((spool / "segments").glob("*.jsonl"))
            for line in segment.read_bytes().splitlines()]  # fmt: skip


@pytest.fixture
def live(make_app: Any, tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """(url, a member's key, the audit spool) of a server whose write deadline is ``DEADLINE``."""
    seeded = seed_store(tmp_path)
    _, key = seeded.store.create_api_key(seeded.acme.id, "reader", "member")
    app = make_app(seeded.store, data_dir=str(tmp_path / "app"), server={"stream_write_timeout_seconds": DEADLINE})
    server, thread, sock, url = start_uvicorn(app)
    try:
        yield url, str(key), tmp_path / "app" / "audit"
    finally:
        stop_uvicorn(server, thread, sock)
        seeded.store.close()


def test_a_stream_whose_client_stops_reading_is_ended_and_its_sequence_freed(
    live: tuple[str, str, Path], served_model: Any
) -> None:
    url, key, spool = live
    assert wait_for(lambda: engine_idle(served_model), timeout=30)
    generated_before = served_model.engine.stats().num_tokens_generated
    ids = [f"slow-reader-{i}-{time.monotonic_ns()}" for i in range(2)]
    readers = [slow_reader(url, key, request_id) for request_id in ids]
    try:
        # A prompt client is served meanwhile.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer(key), timeout=60)
        assert answer.status_code == 200, answer.text
        # Both are cut off, and their sequences and KV blocks are freed long before their 500 tokens.
        assert all(closed_by_server(reader, timeout=60) for reader in readers)
        assert wait_for(lambda: engine_idle(served_model), timeout=30), served_model.engine.stats()
    finally:
        for reader in readers:
            reader.close()
    generated = served_model.engine.stats().num_tokens_generated - generated_before
    assert generated < len(readers) * MAX_TOKENS, generated
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert f'inferflux_kv_blocks_used{{model="{MODEL}"}} 0.0' in text, text
    assert wait_for(lambda: set(ids) <= {e.get("request_id") for e in spooled(spool)}, timeout=10)
    events = {e["request_id"]: e for e in spooled(spool) if e.get("request_id") in ids}
    for request_id in ids:
        event = events[request_id]
        # 499: the connection was gone before the stream's end (as for a client that leaves).
        assert event["status"] == 499 and event["reasons"] == ["client_timeout"], event
        assert event["decision"] == "deny", event  # the server ended it (docs/operators.md lists them so)
        assert event["completion_tokens"] < MAX_TOKENS, event
