"""Slow clients are cut off (issue 18): real sockets against a live server with short deadlines.

A socket that sends nothing, one that stalls inside its headers, and one that
sends its headers and then stalls its body are all closed within the bound
(the last with a 408); an idle kept-alive connection too; a prompt client is
served as before.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from admin_seed import seed_store
from servers import start_uvicorn, stop_uvicorn

DEADLINE = 1.0  # header, body and keep-alive timeouts of the server under test
SLACK = 2.0  # how much later than the deadline the close may be seen
pytestmark = pytest.mark.serial  # closes are timed against the deadlines


@dataclass
class Live:
    host: str
    port: int
    key: str


@pytest.fixture(scope="module")
def live(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    data_dir: Path = tmp_path_factory.mktemp("slow-clients")
    seeded = seed_store(data_dir)
    _, key = seeded.store.create_api_key(seeded.acme.id, "slow", "member")
    limits = {"header_timeout_seconds": DEADLINE, "body_timeout_seconds": DEADLINE, "keep_alive_timeout_seconds": 1}
    app = make_app(seeded.store, data_dir=str(data_dir / "app"), input_limits=limits)
    server, thread, sock, url = start_uvicorn(app)
    try:
        host, port = url.removeprefix("http://").split(":")
        yield Live(host, int(port), key)
    finally:
        stop_uvicorn(server, thread, sock)
        seeded.store.close()


def connect(live: Live) -> socket.socket:
    sock = socket.create_connection((live.host, live.port), timeout=5)
    sock.settimeout(DEADLINE + SLACK + 5)  # a recv that outlives this means the server kept the socket
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took; fails if it never closes."""
    started, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {time.monotonic() - started:.1f} s")
    except ConnectionResetError:
        pass
    return data, time.monotonic() - started


def request_head(live: Live, content_length: int) -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {live.key}\r\ncontent-length: {content_length}\r\n\r\n"
    ).encode()


def test_a_socket_that_sends_nothing_is_closed(live: Live) -> None:
    with connect(live) as sock:
        data, waited = read_until_closed(sock)
    assert data == b"" and waited < DEADLINE + SLACK


def test_a_socket_that_stalls_inside_its_headers_is_closed(live: Live) -> None:
    with connect(live) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\n")
        time.sleep(DEADLINE / 2)
        sock.sendall(b"x-one: more\r\n")  # a trickle must not reset the deadline
        data, waited = read_until_closed(sock)
    assert data == b"" and waited < DEADLINE / 2 + SLACK


def test_a_socket_that_stalls_its_body_gets_408_and_is_closed(live: Live) -> None:
    with connect(live) as sock:
        sock.sendall(request_head(live, 100) + b'{"model": ')
        data, waited = read_until_closed(sock)
    assert waited < DEADLINE + SLACK
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert b"connection: close" in head.lower() and b'"code":"request_timeout"' in body, data


def test_a_prompt_client_is_served_and_an_idle_connection_then_closed(live: Live) -> None:
    body = b'{"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 1}'
    with connect(live) as sock:
        sock.sendall(request_head(live, len(body)) + body)
        answer = b""
        while b'"usage"' not in answer:
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer
        rest, waited = read_until_closed(sock)  # kept alive, idle: closed by the keep-alive timeout
    assert rest == b"" and waited < 1 + SLACK
