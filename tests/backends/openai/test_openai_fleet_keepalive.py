"""The fleet keeps its upstream connections: streams one after another share one TCP connection,
until one sits idle for ``KEEPALIVE_SECONDS``.

A server on uvicorn writes ``data: [DONE]`` and the end of the chunked body
separately; a fleet that closed the response at ``[DONE]`` lost the connection
every time, and each request paid a new TCP connection (found by
``benchmarks/bench_upstream.py``: a ``TIME_WAIT`` socket per request). Both
servers here are real uvicorn servers on loopback; the first records the
client port of every request it gets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fake_upstream import FakeUpstream
from servers import start_uvicorn, stop_uvicorn
from upstream_rules import LOOPBACK

import inferflux.backends.openai.transport as transport
from inferflux.backends.openai.fleet import DRAIN_SECONDS, Fleet, FleetConfig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "stream": True, "max_tokens": 4}


class ClientPorts:
    """An ASGI wrapper that notes the client port of each HTTP request (one port per TCP connection)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.ports: list[int] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.ports.append(scope["client"][1])
        await self.app(scope, receive, send)


async def done_then_silence(scope: Any, receive: Any, send: Any) -> None:
    """One finished chunk and ``[DONE]``, then the body stays open for 5 s: a server that never ends it."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
    await send({"type": "http.response.body", "body": chunk + b"data: [DONE]\n\n", "more_body": True})
    await asyncio.sleep(5)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def serve(app: Any) -> Iterator[str]:
    server, thread, sock, url = start_uvicorn(app)
    server.config.timeout_graceful_shutdown = 1
    try:
        yield url + "/v1"
    finally:
        stop_uvicorn(server, thread, sock)


@pytest.fixture
def recorded() -> Iterator[tuple[ClientPorts, str]]:
    app = ClientPorts(FakeUpstream("keep").app())
    for url in serve(app):
        yield app, url


@pytest.fixture
def never_ending() -> Iterator[str]:
    yield from serve(done_then_silence)


def fleet_for(url: str) -> Fleet:
    return Fleet(FleetConfig(endpoints=(url,), health_interval_seconds=0, idle_timeout_seconds=10.0,
                             timeout_seconds=20.0, routing="least_outstanding", egress=LOOPBACK))  # fmt: skip


async def test_streams_in_a_row_reuse_one_connection(recorded: tuple[ClientPorts, str]) -> None:
    app, url = recorded
    fleet = fleet_for(url)
    try:
        for _ in range(6):
            chunks = [chunk async for chunk in fleet.stream("/chat/completions", CHAT)]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        await fleet.aclose()
    assert len(app.ports) == 6
    assert len(set(app.ports)) == 1, f"{len(set(app.ports))} connections for 6 streams in a row"


async def test_a_body_left_open_after_done_is_not_waited_for(never_ending: str) -> None:
    fleet = fleet_for(never_ending)
    try:
        started = time.monotonic()
        chunks = [chunk async for chunk in fleet.stream("/chat/completions", CHAT)]
        elapsed = time.monotonic() - started
    finally:
        await fleet.aclose()
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["hi"]
    assert elapsed < DRAIN_SECONDS + 2.0  # the server holds the body open for 5 s


async def test_an_idle_pooled_connection_is_let_go_before_the_server_drops_it(
        recorded: tuple[ClientPorts, str], monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Dropped once idle for KEEPALIVE_SECONDS (4 s, under uvicorn's 5 s; here 0.3 s), so the next request
    opens a fresh connection instead of reusing one that the server may be closing just then."""
    monkeypatch.setattr(transport, "KEEPALIVE_SECONDS", 0.3)
    app, url = recorded
    fleet = fleet_for(url)
    try:
        for _ in range(3):
            assert len([chunk async for chunk in fleet.stream("/chat/completions", CHAT)]) == 6
        await asyncio.sleep(1.0)
        assert len([chunk async for chunk in fleet.stream("/chat/completions", CHAT)]) == 6
    finally:
        await fleet.aclose()
    assert len(app.ports) == 4 and len(set(app.ports[:3])) == 1, app.ports
    assert app.ports[3] != app.ports[0], "an idle connection was reused after KEEPALIVE_SECONDS"
