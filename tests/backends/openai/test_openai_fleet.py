"""The upstream fleet client against fake OpenAI-compatible servers on real loopback sockets.

Two fakes (``a`` and ``b``) are served in threads for the whole module; each
test sets their knobs and reads their counters (reset before every test).
Which endpoint answered a stream is read from its chunks'
``system_fingerprint`` (the fake's name). Timeouts are small so that every
test is over in a second or two; the breaker's clock is a fake one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from fake_upstream import FakeUpstream, free_port, running_fake_upstream
from secret_watch import remember
from upstream_rules import LOOPBACK

from inferflux.backends.openai.errors import UpstreamFailed, UpstreamRejected, UpstreamUnavailable
from inferflux.backends.openai.fleet import Fleet, FleetConfig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "stream": True}
API_KEY = remember("sk-fleet-test-0123456789abcdefSECRET")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakeUpstream, FakeUpstream]]:
    with running_fake_upstream("a") as a, running_fake_upstream("b") as b:
        yield a, b


@pytest.fixture
def a(fakes: tuple[FakeUpstream, FakeUpstream]) -> FakeUpstream:
    return fakes[0]


@pytest.fixture
def b(fakes: tuple[FakeUpstream, FakeUpstream]) -> FakeUpstream:
    return fakes[1]


@pytest.fixture(autouse=True)
def fresh_fakes(fakes: tuple[FakeUpstream, FakeUpstream]) -> None:
    for fake in fakes:
        fake.set(**FakeUpstream().knobs.__dict__)
        fake.reset_counters()


@pytest.fixture
async def make_fleet() -> AsyncIterator[Callable[..., Fleet]]:
    """``make_fleet(*urls, clock=None, **config)``: a fleet with test-sized timeouts, closed after the test."""
    made: list[Fleet] = []

    def make(*urls: str, clock: Callable[[], float] | None = None, **overrides: Any) -> Fleet:
        settings: dict[str, Any] = {"health_interval_seconds": 0, "idle_timeout_seconds": 5.0, "timeout_seconds": 10.0,
                                    "connect_timeout_seconds": 1.0, "routing": "least_outstanding", "egress": LOOPBACK,
                                    **overrides}  # fmt: skip
        fleet = Fleet(FleetConfig(endpoints=urls, **settings), **({"clock": clock} if clock else {}))
        made.append(fleet)
        return fleet

    yield make
    for fleet in made:
        await fleet.aclose()


async def collect(fleet: Fleet, body: dict[str, Any] | None = None, path: str = "/chat/completions",
                  **kwargs: Any) -> list[dict[str, Any]]:  # fmt: skip
    return [chunk async for chunk in fleet.stream(path, body or CHAT, **kwargs)]


async def held(fleet: Fleet, stack: contextlib.AsyncExitStack, **kwargs: Any) -> str:
    """Opens a stream and reads its first chunk, keeping it open (in flight) until ``stack`` closes; its endpoint."""
    stream = fleet.stream("/chat/completions", CHAT, **kwargs)
    await stack.enter_async_context(contextlib.aclosing(stream))
    first = await anext(stream)
    return str(first["system_fingerprint"])


async def eventually(condition: Callable[[], bool], timeout: float = 3.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def status(fleet: Fleet, fake: FakeUpstream) -> Any:
    (found,) = [s for s in fleet.statuses() if s.url == fake.url]
    return found


# -- streaming


async def test_stream_yields_each_event_in_order_and_ends_at_done(make_fleet: Callable[..., Fleet],
                                                                   a: FakeUpstream) -> None:  # fmt: skip
    fleet = make_fleet(a.url)
    body = {**CHAT, "max_tokens": 5, "stream_options": {"include_usage": True}}
    chunks = await collect(fleet, body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello, this is a"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    completion = await collect(fleet, {"model": "m", "prompt": "x", "stream": True, "max_tokens": 3}, "/completions")
    assert [c["choices"][0]["text"] for c in completion] == ["Hello", ",", " this", ""]
    assert a.requests == {"chat": 1, "completions": 1}
    assert status(fleet, a).requests == 2 and status(fleet, a).inflight == 0


async def test_chunks_arrive_as_the_upstream_sends_them(make_fleet: Callable[..., Fleet], a: FakeUpstream) -> None:
    """No buffering: the first chunk is in hand while the upstream is still producing the rest."""
    a.set(token_delay=0.2)
    fleet = make_fleet(a.url)
    started = time.monotonic()
    stream = fleet.stream("/chat/completions", {**CHAT, "max_tokens": 10})
    async with contextlib.aclosing(stream):
        await anext(stream)
        await anext(stream)
        assert time.monotonic() - started < 1.0  # the whole answer takes 2 s


async def test_a_json_answer_to_a_stream_is_a_protocol_error(make_fleet: Callable[..., Fleet], a: FakeUpstream) -> None:
    a.set(json_stream=True)
    fleet = make_fleet(a.url)
    with pytest.raises(UpstreamFailed, match="without streaming"):
        await collect(fleet)
    assert a.requests["chat"] == 1  # not retried: the upstream did the whole generation already


# -- placement


async def test_least_outstanding_follows_requests_in_flight(make_fleet: Callable[..., Fleet], a: FakeUpstream,
                                                             b: FakeUpstream) -> None:  # fmt: skip
    fleet = make_fleet(a.url, b.url)
    async with contextlib.AsyncExitStack() as outer:
        first = await held(fleet, outer)
        async with contextlib.AsyncExitStack() as inner:
            second = await held(fleet, inner)
            assert {first, second} == {"a", "b"}
        # `first` still holds one request: every short request goes to the other endpoint, not in turns.
        other = ({"a", "b"} - {first}).pop()
        assert [(await collect(fleet))[0]["system_fingerprint"] for _ in range(4)] == [other] * 4
        assert sorted(s.inflight for s in fleet.statuses()) == [0, 1]
    # Nothing in flight: ties take turns.
    assert sorted([(await collect(fleet))[0]["system_fingerprint"] for _ in range(2)]) == ["a", "b"]


async def test_equal_affinity_goes_to_one_endpoint(make_fleet: Callable[..., Fleet], a: FakeUpstream,
                                                    b: FakeUpstream) -> None:  # fmt: skip
    fleet = make_fleet(a.url, b.url, routing="prefix")
    placed: dict[bytes, set[str]] = {}
    for round_ in range(3):
        for n in range(12):
            key = f"tenant-1:prefix-{n}".encode()
            chunks = await collect(fleet, affinity=key)
            placed.setdefault(key, set()).add(chunks[0]["system_fingerprint"])
    assert all(len(where) == 1 for where in placed.values()), placed
    assert set().union(*placed.values()) == {"a", "b"}  # keys spread over both
    # Another fleet (another gateway replica) puts every key in the same place.
    again = make_fleet(a.url, b.url, routing="prefix")
    for key, where in placed.items():
        assert {(await collect(again, affinity=key))[0]["system_fingerprint"]} == where


async def test_a_hot_key_spills_over_the_load_bound(make_fleet: Callable[..., Fleet], a: FakeUpstream,
                                                     b: FakeUpstream) -> None:  # fmt: skip
    fleet = make_fleet(a.url, b.url, routing="prefix")
    key = b"tenant-1:hot-prefix"
    owner = (await collect(fleet, affinity=key))[0]["system_fingerprint"]
    async with contextlib.AsyncExitStack() as stack:
        places = [await held(fleet, stack, affinity=key) for _ in range(6)]
        # ceil(1.25 * average in flight) bounds the owner: 4 of 6, and the rest spill to the neighbour.
        assert places.count(owner) == 4 and len(places) - places.count(owner) == 2, places
        assert places[:2] == [owner, owner]
    # Once the load is gone the key is the owner's again.
    assert (await collect(fleet, affinity=key))[0]["system_fingerprint"] == owner


# -- retries and failover


async def test_a_5xx_before_the_first_byte_fails_over(make_fleet: Callable[..., Fleet], a: FakeUpstream,
                                                       b: FakeUpstream) -> None:  # fmt: skip
    a.set(fail_status=503, fail_count=1)
    fleet = make_fleet(a.url, b.url)  # a first: ties start at the first endpoint
    chunks = await collect(fleet)
    assert chunks[0]["system_fingerprint"] == "b"
    assert a.requests["chat"] == 1 and b.requests["chat"] == 1
    assert (status(fleet, a).failures, status(fleet, a).last_error) == (1, "HTTP 503")
    assert status(fleet, b).failures == 0


async def test_a_dead_endpoint_fails_over_and_one_alone_is_unavailable(make_fleet: Callable[..., Fleet],
                                                                       b: FakeUpstream) -> None:  # fmt: skip
    dead = f"http://127.0.0.1:{free_port()}/v1"
    fleet = make_fleet(dead, b.url)
    assert (await collect(fleet))[0]["system_fingerprint"] == "b"
    (dead_status,) = [s for s in fleet.statuses() if s.url == dead]
    assert dead_status.last_error == "connect error"
    alone = make_fleet(dead, retries=1)
    with pytest.raises(UpstreamUnavailable) as caught:
        await collect(alone)
    assert caught.value.retry_after == 1.0
    assert alone.statuses()[0].failures == 2  # the first try and one retry


async def test_5xx_everywhere_is_a_failure_after_the_retries(make_fleet: Callable[..., Fleet], a: FakeUpstream,
                                                              b: FakeUpstream) -> None:  # fmt: skip
    for fake in (a, b):
        fake.set(fail_status=500, fail_count=10, fail_message="Traceback: at /srv/vllm/engine.py line 12")
    fleet = make_fleet(a.url, b.url, retries=2)
    with pytest.raises(UpstreamFailed) as caught:
        await collect(fleet)
    assert str(caught.value) == "the upstream failed (HTTP 500)"  # never the upstream's internals
    assert a.requests["chat"] + b.requests["chat"] == 3
    assert a.requests["chat"] >= 1 and b.requests["chat"] >= 1


async def test_a_4xx_is_the_request_s_fault_and_not_retried(make_fleet: Callable[..., Fleet], a: FakeUpstream,
                                                             b: FakeUpstream) -> None:  # fmt: skip
    a.set(models=["served"])
    fleet = make_fleet(a.url, b.url)
    with pytest.raises(UpstreamRejected) as caught:
        await collect(fleet)
    error = caught.value
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
    assert str(error) == "The model `m` does not exist."
    assert b.requests["chat"] == 0
    assert status(fleet, a).failures == 0 and status(fleet, a).circuit == "closed"


async def test_a_credential_refusal_says_nothing_of_the_upstream_s_text(make_fleet: Callable[..., Fleet],
                                                                        a: FakeUpstream) -> None:  # fmt: skip
    a.set(fail_status=401, fail_count=1, fail_message=f"bad key {API_KEY}")
    with pytest.raises(UpstreamRejected) as caught:
        await collect(make_fleet(a.url, api_key=API_KEY))
    assert caught.value.status == 401 and str(caught.value) == "the upstream refused the gateway's credential"


async def test_no_retry_after_the_first_byte(make_fleet: Callable[..., Fleet], a: FakeUpstream,
                                              b: FakeUpstream) -> None:  # fmt: skip
    a.set(cut_after=3)
    fleet = make_fleet(a.url, b.url)
    received: list[dict[str, Any]] = []
    with pytest.raises(UpstreamFailed, match="lost mid-stream"):
        async for chunk in fleet.stream("/chat/completions", CHAT):
            received.append(chunk)
    assert len(received) == 3 and {c["system_fingerprint"] for c in received} == {"a"}
    assert b.requests["chat"] == 0
    assert status(fleet, a).last_error == "stream cut" and status(fleet, a).inflight == 0


async def test_an_error_event_mid_stream_ends_it(make_fleet: Callable[..., Fleet]) -> None:
    """An upstream reporting an error in place of a chunk: the fleet raises, with the scrubbed message."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    body = (b'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'
            b'data: {"error":{"message":"out of memory on http://10.1.2.3:8000","type":"server_error"}}\n\n')

    async def chat(request: Any) -> Response:
        return Response(body, media_type="text/event-stream")

    from servers import start_uvicorn, stop_uvicorn

    server, thread, sock, url = start_uvicorn(Starlette(routes=[Route("/v1/chat/completions", chat,
                                                                      methods=["POST"])]))  # fmt: skip
    try:
        fleet = make_fleet(url + "/v1")
        stream = fleet.stream("/chat/completions", CHAT)
        assert (await anext(stream))["choices"][0]["delta"]["content"] == "x"
        with pytest.raises(UpstreamFailed) as caught:
            await anext(stream)
        assert str(caught.value) == "the upstream failed mid-stream: out of memory on [upstream]"
    finally:
        stop_uvicorn(server, thread, sock)


# -- circuit breaker, health, backpressure


async def test_the_breaker_opens_half_opens_and_closes(make_fleet: Callable[..., Fleet], a: FakeUpstream) -> None:
    clock = FakeClock()
    fleet = make_fleet(a.url, clock=clock, retries=0, breaker_failures=3, breaker_reset_seconds=10.0)
    a.set(fail_status=502, fail_count=3)
    for _ in range(3):
        with pytest.raises(UpstreamFailed):
            await collect(fleet)
    assert fleet.statuses()[0].circuit == "open"
    clock.now += 4
    with pytest.raises(UpstreamUnavailable) as caught:
        await collect(fleet)
    assert caught.value.retry_after == pytest.approx(6.0)
    assert a.requests["chat"] == 3  # refused without a request

    clock.now += 6
    assert fleet.statuses()[0].circuit == "half_open"
    a.set(fail_count=1)  # the probe fails: open for another period
    with pytest.raises(UpstreamFailed):
        await collect(fleet)
    assert fleet.statuses()[0].circuit == "open"

    clock.now += 10
    a.set(header_delay=0.3)  # the probe is slow: while it is out, nothing else is let through
    probe = asyncio.ensure_future(collect(fleet))
    await eventually(lambda: a.requests["chat"] == 5, what="the probe at the upstream")
    with pytest.raises(UpstreamUnavailable):
        await collect(fleet)
    assert (await probe)[0]["system_fingerprint"] == "a"
    assert fleet.statuses()[0].circuit == "closed"
    a.set(header_delay=0.0)
    await collect(fleet)
    assert fleet.statuses()[0].failures == 4


async def test_active_checks_mark_an_endpoint_down_and_up(make_fleet: Callable[..., Fleet], a: FakeUpstream,
                                                          b: FakeUpstream) -> None:  # fmt: skip
    dead = f"http://127.0.0.1:{free_port()}/v1"
    fleet = make_fleet(a.url, b.url, dead, health_interval_seconds=0.05)
    await fleet.start()
    await fleet.start()  # idempotent
    await eventually(lambda: a.requests["models"] >= 1 and b.requests["models"] >= 1, what="both checked")
    assert [s.healthy for s in fleet.statuses()][:2] == [True, True]
    await eventually(lambda: not fleet.statuses()[2].healthy, what="the dead endpoint marked unhealthy")

    a.set(models_status=503)
    await eventually(lambda: not status(fleet, a).healthy, what="a marked unhealthy")
    chunks = [await collect(fleet) for _ in range(3)]
    assert {c[0]["system_fingerprint"] for c in chunks} == {"b"}  # neither a nor the dead one is tried
    assert a.requests["chat"] == 0

    a.set(models_status=200)
    await eventually(lambda: status(fleet, a).healthy, what="a healthy again")
    placed = {(await collect(fleet))[0]["system_fingerprint"] for _ in range(4)}
    assert placed == {"a", "b"}


async def test_a_saturated_fleet_refuses_at_once(make_fleet: Callable[..., Fleet], a: FakeUpstream,
                                                 b: FakeUpstream) -> None:  # fmt: skip
    fleet = make_fleet(a.url, b.url, max_inflight_per_endpoint=2)
    async with contextlib.AsyncExitStack() as stack:
        places = [await held(fleet, stack) for _ in range(4)]
        assert sorted(places) == ["a", "a", "b", "b"]
        started = time.monotonic()
        with pytest.raises(UpstreamUnavailable) as caught:
            await collect(fleet)
        assert time.monotonic() - started < 0.2
        assert caught.value.retry_after == 1.0
        assert a.requests["chat"] + b.requests["chat"] == 4
    assert len(await collect(fleet)) > 1  # slots free again


# -- timeouts and cancellation


async def test_a_stall_mid_stream_is_cut_at_the_idle_timeout(make_fleet: Callable[..., Fleet], a: FakeUpstream,
                                                             b: FakeUpstream) -> None:  # fmt: skip
    a.set(stall_after=2)
    fleet = make_fleet(a.url, b.url, idle_timeout_seconds=0.3)
    received = 0
    started = time.monotonic()
    with pytest.raises(UpstreamFailed, match="sent nothing for 0.3 s"):
        async for _ in fleet.stream("/chat/completions", CHAT):
            received += 1
    assert received == 2 and 0.25 < time.monotonic() - started < 2.0
    assert b.requests["chat"] == 0
    assert status(fleet, a).last_error == "stalled"
    await eventually(lambda: a.disconnects == 1, what="the stalled upstream seeing the connection closed")


async def test_silence_before_the_answer_is_retried_elsewhere(make_fleet: Callable[..., Fleet], a: FakeUpstream,
                                                              b: FakeUpstream) -> None:  # fmt: skip
    a.set(header_delay=2.0)
    fleet = make_fleet(a.url, b.url, idle_timeout_seconds=0.3)
    assert (await collect(fleet))[0]["system_fingerprint"] == "b"
    assert status(fleet, a).last_error == "timed out"


async def test_the_whole_request_is_bounded(make_fleet: Callable[..., Fleet], a: FakeUpstream) -> None:
    a.set(token_delay=0.1)  # never silent for long, but 50 tokens take 5 s
    fleet = make_fleet(a.url, timeout_seconds=0.6, idle_timeout_seconds=5.0)
    started = time.monotonic()
    with pytest.raises(UpstreamFailed, match="did not finish within 0.6 s"):
        await collect(fleet, {**CHAT, "max_tokens": 50})
    assert time.monotonic() - started < 1.2
    await eventually(lambda: a.disconnects == 1, what="the upstream seeing the connection closed")
    assert status(fleet, a).inflight == 0


async def test_closing_the_iterator_closes_the_upstream_request(make_fleet: Callable[..., Fleet],
                                                                a: FakeUpstream) -> None:  # fmt: skip
    a.set(token_delay=0.05)
    fleet = make_fleet(a.url)
    stream = fleet.stream("/chat/completions", {**CHAT, "max_tokens": 200})
    await anext(stream)
    await anext(stream)
    await stream.aclose()
    await eventually(lambda: a.disconnects == 1 and a.active == 0, timeout=2.0, what="the upstream stream aborted")
    assert a.completed == 0 and fleet.statuses()[0].inflight == 0


async def test_cancelling_the_reader_closes_the_upstream_request(make_fleet: Callable[..., Fleet],
                                                                 a: FakeUpstream) -> None:  # fmt: skip
    a.set(token_delay=0.05)
    fleet = make_fleet(a.url)
    first = asyncio.Event()

    async def read() -> None:
        async for _ in fleet.stream("/chat/completions", {**CHAT, "max_tokens": 200}):
            first.set()

    task = asyncio.ensure_future(read())
    await asyncio.wait_for(first.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: a.disconnects == 1, timeout=2.0, what="the upstream stream aborted")
    status_a = fleet.statuses()[0]
    assert status_a.inflight == 0 and status_a.failures == 0  # the client left: not the endpoint's fault


# -- what travels upstream, what comes back


async def test_only_allowed_headers_and_the_fleet_s_key_go_upstream(make_fleet: Callable[..., Fleet],
                                                                    a: FakeUpstream) -> None:  # fmt: skip
    fleet = make_fleet(a.url, api_key=API_KEY)
    sent = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "Authorization": "Bearer client-key", "Cookie": "session=1", "Host": "evil.example",
            "X-Bad": "one\r\nInjected: yes"}  # fmt: skip
    await collect(fleet, headers=sent)
    received = a.headers[-1]
    assert received["authorization"] == f"Bearer {API_KEY}"
    assert received["traceparent"] == sent["traceparent"]
    assert received["host"] == a.url.split("/")[2]
    assert set(received) <= {"host", "user-agent", "accept", "accept-encoding", "connection", "content-type",
                             "content-length", "authorization", "traceparent"}, received  # fmt: skip
    assert received["accept-encoding"] == "identity" and received["user-agent"] == "inferflux"


async def test_the_api_key_and_addresses_never_show(make_fleet: Callable[..., Fleet], a: FakeUpstream) -> None:
    config = FleetConfig(endpoints=(a.url,), api_key=API_KEY, egress=LOOPBACK)
    assert API_KEY not in repr(config) and API_KEY not in str(config)
    fleet = make_fleet(a.url, api_key=API_KEY, retries=0)
    host = a.url.split("/")[2]
    echoed = f"invalid header 'Authorization: Bearer {API_KEY}' sent to {a.url}/chat/completions via {host} "
    echoed += "x" * 400
    a.set(fail_status=400, fail_count=1, fail_message=echoed)
    with pytest.raises(UpstreamRejected) as caught:
        await collect(fleet)
    message = str(caught.value)
    assert API_KEY not in message and host not in message and "127.0.0.1" not in message
    assert message.startswith("invalid header 'Authorization: Bearer [redacted]' sent to [upstream] via [upstream] x")
    assert len(message) <= 300

    a.set(fail_status=502, fail_count=1, fail_text=f"<html>proxy {API_KEY} {a.url}</html>")
    with pytest.raises(UpstreamFailed) as failed:
        await collect(fleet)
    assert str(failed.value) == "the upstream failed (HTTP 502)"
    shown = repr(fleet.statuses()) + repr(fleet.config) + repr(caught.value.__dict__) + repr(failed.value.__dict__)
    assert API_KEY not in shown


def test_config_refuses_what_could_leak_or_mislead() -> None:
    for url, why in [("ftp://h/v1", "scheme"), ("http://user:pw@h/v1", "credentials"), ("http:///v1", "no host"),
                     ("http://h/v1?key=1", "query"), ("http://h/v1#x", "fragment"), ("http://h:99999/v1", "not a URL"),
                     (" http://h/v1", "not a URL"), ("http://h/v\n1", "not a URL")]:  # fmt: skip
        with pytest.raises(ValueError) as caught:
            FleetConfig(endpoints=(url,))
        assert "pw" not in str(caught.value), why
    for bad in [{"endpoints": ()}, {"endpoints": ("http://h/v1", "http://h/v1/")}, {"endpoints": "http://h/v1"},
                {"api_key": "k\r\nX: y"}, {"timeout_seconds": 0}, {"max_inflight_per_endpoint": 0},
                {"retries": -1}, {"routing": "random"}, {"health_interval_seconds": -1}]:  # fmt: skip
        settings: dict[str, Any] = {"endpoints": ("http://h/v1",), **bad}
        with pytest.raises(ValueError):
            FleetConfig(**settings)
    config = FleetConfig(endpoints=["https://h.example:8443/v1/"], timeout_seconds=30)  # type: ignore[arg-type]
    assert config.endpoints == ("https://h.example:8443/v1",) and config.idle_seconds == 30


async def test_a_closed_fleet_refuses(make_fleet: Callable[..., Fleet], a: FakeUpstream) -> None:
    fleet = make_fleet(a.url, health_interval_seconds=0.05)
    await fleet.start()
    await fleet.aclose()
    with pytest.raises(UpstreamUnavailable):
        await collect(fleet)



# -- a whole JSON answer (embeddings)

EMBED = {"model": "m", "input": ["one", "two words"], "encoding_format": "float"}


async def test_post_returns_the_json_answer_after_failing_over(make_fleet: Callable[..., Fleet], a: FakeUpstream,
                                                              b: FakeUpstream) -> None:  # fmt: skip
    a.set(fail_status=503, fail_count=1)
    fleet = make_fleet(a.url, b.url, api_key=API_KEY)
    answer = await fleet.post("/embeddings", EMBED, headers={"traceparent": "00-1-2-01", "Cookie": "x"})
    assert [d["embedding"] for d in answer["data"]] == [[3.0, 111.0, 0.5, 1.0], [9.0, 116.0, 0.5, 1.0]]
    assert answer["usage"]["prompt_tokens"] == 3
    assert (a.requests["embeddings"], b.requests["embeddings"]) == (1, 1)
    sent = b.headers[-1]
    assert sent["accept"] == "application/json" and sent["authorization"] == f"Bearer {API_KEY}"
    assert sent["traceparent"] == "00-1-2-01" and "cookie" not in sent
    assert status(fleet, a).last_error == "HTTP 503" and status(fleet, b).inflight == 0


async def test_post_passes_a_4xx_on_and_refuses_what_is_not_a_json_object(make_fleet: Callable[..., Fleet],
                                                                          a: FakeUpstream) -> None:  # fmt: skip
    fleet = make_fleet(a.url, retries=0)
    a.set(fail_status=400, fail_count=1, fail_message="This model does not support dimensions")
    with pytest.raises(UpstreamRejected) as rejected:
        await fleet.post("/embeddings", EMBED)
    assert rejected.value.status == 400 and str(rejected.value) == "This model does not support dimensions"
    a.set(fail_status=200, fail_count=1, fail_text="[1, 2]")  # a 200 whose body is no answer (text/plain)
    with pytest.raises(UpstreamFailed, match="not JSON"):
        await fleet.post("/embeddings", EMBED)
    assert status(fleet, a).last_error == "not JSON" and status(fleet, a).inflight == 0
    a.set(fail_status=500, fail_count=1, fail_text=f"Traceback {API_KEY}")
    with pytest.raises(UpstreamFailed) as failed:
        await fleet.post("/embeddings", EMBED)
    assert str(failed.value) == "the upstream failed (HTTP 500)"


async def test_a_cookie_an_upstream_sets_never_rides_on_later_requests() -> None:
    """One client serves every tenant: an upstream's Set-Cookie (a load balancer's session) must not stick."""
    from servers import start_uvicorn, stop_uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    seen: list[str | None] = []

    async def chat(request: Request) -> Response:
        seen.append(request.headers.get("cookie"))
        body = b'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
        return Response(body, media_type="text/event-stream",
                        headers={"set-cookie": "lb_session=tenant-a; Path=/"})  # fmt: skip

    server, thread, sock, url = start_uvicorn(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]))
    fleet = Fleet(FleetConfig(endpoints=(url + "/v1",), health_interval_seconds=0, egress=LOOPBACK))
    try:
        for _ in range(3):
            assert [e async for e in fleet.stream("/chat/completions", {"stream": True})]
        assert seen == [None, None, None]
    finally:
        await fleet.aclose()
        await asyncio.to_thread(stop_uvicorn, server, thread, sock)
