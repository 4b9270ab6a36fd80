"""Console sign-in throttling: a source that failed too often gets 429 with Retry-After, on the audit trail,
without its key being tried; other sources sign in; the per-source state stays bounded."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from console_support import CSRF
from servers import start_uvicorn, stop_uvicorn

from inferflux.gateway.console.throttle import SignInThrottle, source_of
from inferflux.policy.store import PolicyStore, StoreSettings

FAILURES = 3
WINDOW = 600.0
WRONG = "ifx_aaaaaaaaaaaa_" + "A" * 43


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """(url, the platform admin's key, the app's data directory): a console over a real socket."""
    from inferflux.gateway.app import create_app
    from inferflux.gateway.models.served import ModelManager
    from inferflux.gateway.settings import Settings

    data_dir: Path = tmp_path_factory.mktemp("throttle")
    store = PolicyStore.open(StoreSettings(), data_dir)
    admin = str(store.ensure_bootstrap_admin())
    settings = Settings(data_dir=data_dir / "app", audit={"refusal_aggregation_seconds": 60},
                        console={"sign_in_failures": FAILURES, "sign_in_window_seconds": WINDOW})  # fmt: skip
    app = create_app(settings, ModelManager(expected=[]), store=store, owns_models=False)
    server, thread, sock, url = start_uvicorn(app)
    try:
        yield url, admin, data_dir / "app"
    finally:
        stop_uvicorn(server, thread, sock)
        store.close()


def browser(url: str, source: str) -> httpx.Client:
    """A client with its own cookies, connecting from ``source`` (an address of the loopback network)."""
    return httpx.Client(base_url=url, transport=httpx.HTTPTransport(local_address=source), follow_redirects=False)


def attempt(client: httpx.Client, key: str) -> httpx.Response:
    token = CSRF.search(client.get("/console/login").text).group(1)  # type: ignore[union-attr]
    return client.post("/console/login", data={"csrf": token, "api_key": key, "next": "/console/"})


def sign_in_refusals(data_dir: Path, status: int) -> list[dict[str, Any]]:
    """The spool's refusal events of the sign-in form (its route is named within the console's mount)."""
    segments = sorted((data_dir / "audit" / "segments").glob("*.jsonl"))
    found = [json.loads(line)["event"] for segment in segments for line in segment.read_text().splitlines()]
    return [e for e in found if e.get("route") in ("POST /login", "POST /console/login") and e.get("status") == status]


def test_a_source_that_failed_too_often_gets_429_with_retry_after_and_it_is_audited(
    gateway: tuple[str, str, Path],
) -> None:
    url, admin, data_dir = gateway
    with browser(url, "127.0.0.3") as guesser, browser(url, "127.0.0.4") as other:
        for _ in range(FAILURES):
            assert attempt(guesser, WRONG).status_code == 401
        throttled = attempt(guesser, admin)  # the right key too: nothing is tried while the source waits
        assert throttled.status_code == 429, throttled.text
        assert 0 < int(throttled.headers["retry-after"]) <= WINDOW
        assert "Too many failed sign-ins" in throttled.text and "inferflux_console" not in throttled.cookies
        assert guesser.get("/console/").status_code == 303  # not signed in
        # Another address is not held up by this one's failures.
        signed_in = attempt(other, admin)
        assert signed_in.status_code == 303 and other.get("/console/").status_code == 200
    deadline = time.monotonic() + 10  # a refusal's first event is in the spool before its answer; allow a moment
    while not (refusals := sign_in_refusals(data_dir, 429)) and time.monotonic() < deadline:
        time.sleep(0.1)
    [event] = refusals
    assert event["decision"] == "deny" and event["reasons"] == ["sign_in_throttled"], event
    assert event["principal"] == "addr:127.0.0.3" and admin not in json.dumps(event)
    failures = sign_in_refusals(data_dir, 401)
    assert failures and failures[0]["reasons"] == ["invalid_api_key"], failures


def test_failures_leave_the_window_and_a_sign_in_forgets_them() -> None:
    now = [0.0]
    throttle = SignInThrottle(3, 60.0, clock=lambda: now[0])
    for _ in range(3):
        assert throttle.retry_after("a") is None
        throttle.failed("a")
        now[0] += 10
    assert throttle.retry_after("a") == 30  # the first failure (t=0) leaves the window at t=60; now t=30
    now[0] = 60.0
    assert throttle.retry_after("a") is None  # one failure left the window: one attempt more
    throttle.failed("a")
    assert throttle.retry_after("a") == 10
    throttle.succeeded("a")
    assert throttle.retry_after("a") is None and len(throttle) == 0


def test_the_state_is_bounded_whatever_the_number_of_sources() -> None:
    throttle = SignInThrottle(2, 60.0, max_sources=100, clock=lambda: 0.0)
    for i in range(10_000):
        throttle.failed(f"10.0.{i // 256}.{i % 256}")
        throttle.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(throttle) == 100
    assert throttle.retry_after("10.0.39.15") is not None  # the latest are kept, the oldest forgotten
    assert throttle.retry_after("10.0.0.0") is None


def test_an_ipv6_client_is_throttled_by_its_64() -> None:
    assert source_of(("2001:db8:1:2:aaaa::1", 1)) == source_of(("2001:db8:1:2:bbbb::9", 2)) == "2001:db8:1:2::/64"
    assert source_of(("::ffff:192.0.2.1", 1)) == source_of(("192.0.2.1", 1)) == "192.0.2.1"
    assert source_of(None) == "unknown" and source_of(("testclient", 50000)) == "testclient"
