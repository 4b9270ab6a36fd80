"""The fleet's HTTP session on real sockets: https to an upstream whose certificate a private CA signed.

The upstream is the fake (``fake_upstream.py``) on a real uvicorn server with a
certificate of a CA made for the test. (Connection reuse and its idle limit:
``test_openai_fleet_keepalive.py``.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from audit_support import make_test_ca
from fake_upstream import FakeUpstream
from servers import free_loopback_socket, stop_uvicorn
from upstream_rules import LOOPBACK

from inferflux.backends.openai.errors import UpstreamUnavailable
from inferflux.backends.openai.fleet import Fleet, FleetConfig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True, "max_tokens": 3}


def fleet_for(url: str, **overrides: Any) -> Fleet:
    settings: dict[str, Any] = {"health_interval_seconds": 0, "idle_timeout_seconds": 5.0, "timeout_seconds": 10.0,
                                "connect_timeout_seconds": 2.0, "routing": "least_outstanding", "retries": 0,
                                "egress": LOOPBACK, **overrides}  # fmt: skip
    return Fleet(FleetConfig(endpoints=(url,), **settings))


async def text_of(fleet: Fleet) -> str:
    chunks = [chunk async for chunk in fleet.stream("/chat/completions", CHAT)]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


@pytest.fixture(scope="module")
def https_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The fake on https://127.0.0.1 with a certificate of a test CA; (base URL, the CA's PEM file)."""
    import uvicorn

    ca, cert, key = make_test_ca(tmp_path_factory.mktemp("tls"))
    sock = free_loopback_socket()
    config = uvicorn.Config(FakeUpstream("tls").app(), log_level="warning", ssl_certfile=str(cert),
                            ssl_keyfile=str(key))  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the https fake did not start"
        threading.Event().wait(0.02)
    try:
        yield f"https://127.0.0.1:{sock.getsockname()[1]}/v1", ca
    finally:
        stop_uvicorn(server, thread, sock)


async def test_https_with_the_private_ca_in_ca_file(https_upstream: tuple[str, Path]) -> None:
    url, ca = https_upstream
    fleet = fleet_for(url, ca_file=str(ca))
    try:
        assert await text_of(fleet) == "Hello, this"
    finally:
        await fleet.aclose()


async def test_https_without_the_ca_is_refused_as_a_connect_error(https_upstream: tuple[str, Path]) -> None:
    """The system's CAs do not know the test CA: the handshake fails and nothing is sent."""
    url, _ = https_upstream
    fleet = fleet_for(url)
    try:
        with pytest.raises(UpstreamUnavailable):
            await text_of(fleet)
        assert fleet.statuses()[0].last_error == "connect error"
    finally:
        await fleet.aclose()


def test_an_unreadable_ca_file_refuses_the_fleet(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("not a certificate")
    for path in (tmp_path / "ca.pem", tmp_path / "missing.pem"):
        with pytest.raises(ValueError, match="ca_file"):
            fleet_for("https://127.0.0.1:1/v1", ca_file=str(path))
