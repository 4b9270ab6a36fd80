"""``/v1/websocket`` over a real socket, with the ``websockets`` client, on the real model.

One connection carries several requests, each through the whole chain of its
HTTP route: the events carry their request's id, the greedy text is the HTTP
route's, the audit event is the HTTP route's but for its route, the handshake is
refused (401) without credentials, a tenant's allow-list answers 404 in an error
event, a key revoked mid-connection stops new requests. The connection's own
limits (requests in flight, message size, malformed messages) answer error
events and leave it open; a cancel ends its request as a disconnect does (499);
a drain lets the requests finish and closes 1001. The server pings, and drops a
peer that does not answer; an idle connection is closed (1000), one with a
request running is not.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets
from websockets.asyncio.client import ClientConnection, connect
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from inferflux.policy.store import PolicyStore, StoreSettings
from app_world import LiveWorld, open_live_world, wait_until
from servers import start_uvicorn, stop_uvicorn

MODEL = DEFAULT_MODEL_NAME
POLL = 0.05
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24, "temperature": 0}  # fmt: skip
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
LONG = {**CHAT, "max_tokens": 400, "ignore_eos": True}
WS = {"max_in_flight": 3, "max_message_bytes": 64 * 1024}
HEADER_SECONDS = 1.0  # the HTTP header deadline, which an upgraded connection outlives


class World(LiveWorld):
    tenant_prefix = "w"

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/websocket"

    def connect(self, key: str | None) -> Any:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return connect(self.ws_url, additional_headers=headers, open_timeout=30)


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_live_world(World, make_app, tmp_path_factory.mktemp("websocket"), auth={"revocation_poll_seconds": POLL},
                         websocket=WS, input_limits={"header_timeout_seconds": HEADER_SECONDS}) as world:  # fmt: skip
        yield world


async def send(ws: ClientConnection, id: str, body: dict[str, Any], type: str = "chat.completions") -> None:
    await ws.send(json.dumps({"id": id, "type": type, "body": body}))


async def until_end(ws: ClientConnection, ids: set[str], timeout: float = 120) -> list[dict[str, Any]]:
    """Every event until each of ``ids`` has its end (done, error, cancelled)."""
    events: list[dict[str, Any]] = []
    open_ids = set(ids)
    async with asyncio.timeout(timeout):
        while open_ids:
            event = json.loads(await ws.recv())
            events.append(event)
            if event["type"] in ("done", "error", "cancelled"):
                open_ids.discard(event["id"])
    return events


def text_of(events: list[dict[str, Any]], id: str) -> str:
    parts = []
    for e in events:
        if e["id"] == id and e["type"] == "chunk":
            choice = e["data"]["choices"][0] if e["data"]["choices"] else {}
            parts.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(parts)


def end_of(events: list[dict[str, Any]], id: str) -> dict[str, Any]:
    return next(e for e in events if e["id"] == id and e["type"] in ("done", "error", "cancelled"))


def test_two_requests_share_a_connection_and_say_what_http_says(world: World) -> None:
    _, key = world.tenant_key()

    async def run() -> list[dict[str, Any]]:
        async with world.connect(key) as ws:
            await send(ws, "a", CHAT)
            await send(ws, "b", COMPLETION, "completions")
            return await until_end(ws, {"a", "b"})

    events = asyncio.run(run())
    assert {e["id"] for e in events} == {"a", "b"}
    assert end_of(events, "a")["type"] == end_of(events, "b")["type"] == "done"
    order = [e["id"] for e in events]
    assert order.index("b") < len(order) - 1 - order[::-1].index("a"), "the two streams did not interleave"
    assert all(e["data"]["object"] == "chat.completion.chunk" for e in events if e["id"] == "a" and e["type"] == "chunk")
    auth = {"authorization": f"Bearer {key}"}
    chat = httpx.post(f"{world.url}/v1/chat/completions", json=CHAT, headers=auth, timeout=120).json()
    text = httpx.post(f"{world.url}/v1/completions", json=COMPLETION, headers=auth, timeout=120).json()
    assert text_of(events, "a") == chat["choices"][0]["message"]["content"] != ""
    assert text_of(events, "b") == text["choices"][0]["text"] != ""


def test_a_connection_outlives_the_http_header_deadline(world: World) -> None:
    _, key = world.tenant_key()

    async def run() -> list[dict[str, Any]]:
        async with world.connect(key) as ws:
            await asyncio.sleep(HEADER_SECONDS * 2.5)
            await send(ws, "late", CHAT)
            return await until_end(ws, {"late"})

    assert end_of(asyncio.run(run()), "late")["type"] == "done"


def test_the_audit_event_is_the_http_routes_but_for_its_route(world: World) -> None:
    tenant, key = world.tenant_key()

    async def run() -> list[dict[str, Any]]:
        async with world.connect(key) as ws:
            await send(ws, "a", {**CHAT, "stream_options": {"include_usage": True}})
            return await until_end(ws, {"a"})

    ws_id = end_of(asyncio.run(run()), "a")["request_id"]
    http = httpx.post(f"{world.url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=120,
                      headers={"authorization": f"Bearer {key}"})  # fmt: skip
    http_id = http.headers["x-request-id"]
    world.settled()
    events = world.events()
    ws_event, http_event = events[ws_id], events[http_id]
    assert http_event["route"] == "POST /v1/chat/completions"
    assert ws_event["route"] == "WEBSOCKET /v1/chat/completions"
    same = ("decision", "tenant_id", "principal", "key_id", "model", "status", "prompt_tokens", "completion_tokens",
            "kind", "reasons", "findings", "user", "detail", "prompt_hmac", "completion_hmac")  # fmt: skip
    assert {k: ws_event.get(k) for k in same} == {k: http_event.get(k) for k in same}
    assert ws_event["tenant_id"] == tenant.id and ws_event["status"] == 200 and ws_event["completion_tokens"]
    assert ws_event["prompt_hmac"] and ws_event["completion_hmac"], "the events carry no digests to compare"


def test_the_handshake_needs_credentials(world: World) -> None:
    async def refused(key: str | None) -> Any:
        with pytest.raises(websockets.exceptions.InvalidStatus) as caught:
            async with world.connect(key):
                pass
        return caught.value.response

    _, valid = world.tenant_key()

    async def in_the_url() -> Any:  # a token in the query string or a cookie is never read: logs would keep it
        with pytest.raises(websockets.exceptions.InvalidStatus) as caught:
            async with connect(f"{world.ws_url}?api_key={valid}&access_token={valid}", open_timeout=30,
                               additional_headers={"cookie": f"api_key={valid}"}):  # fmt: skip
                pass
        return caught.value.response

    for key, code in ((None, "missing_credentials"), ("ifx_not-a-real-key", "invalid_api_key")):
        response = asyncio.run(refused(key))
        assert response.status_code == 401
        assert json.loads(response.body)["error"]["code"] == code
        request_id = response.headers["x-request-id"]
        wait_until(lambda: request_id in world.events())
        event = world.events()[request_id]
        assert (event["route"], event["status"], event["decision"]) == ("GET /v1/websocket", 401, "deny")
    # Last: its refusal is a repeat of the first (aggregated, so not on the trail at once).
    response = asyncio.run(in_the_url())
    assert response.status_code == 401 and json.loads(response.body)["error"]["code"] == "missing_credentials"


def test_a_model_outside_the_allow_list_is_a_404_event_and_the_connection_goes_on(world: World) -> None:
    _, key = world.tenant_key(allowed_models=["some-other-model"])

    async def run() -> list[dict[str, Any]]:
        async with world.connect(key) as ws:
            await send(ws, "hidden", CHAT)
            first = await until_end(ws, {"hidden"})
            await send(ws, "again", CHAT)
            return first + await until_end(ws, {"again"})

    events = asyncio.run(run())
    for id in ("hidden", "again"):
        end = end_of(events, id)
        assert end["type"] == "error" and end["status"] == 404 and end["error"]["code"] == "model_not_found", end


def test_a_key_revoked_mid_connection_stops_new_requests(world: World) -> None:
    tenant, _ = world.tenant_key()
    record, key = world.store.create_api_key(tenant.id, "short-lived", "member")

    async def run() -> list[dict[str, Any]]:
        async with world.connect(key) as ws:
            await send(ws, "before", CHAT)
            events = await until_end(ws, {"before"})
            world.store.revoke_api_key(tenant.id, record.id)
            await asyncio.sleep(POLL * 20)
            await send(ws, "after", CHAT)
            return events + await until_end(ws, {"after"})

    events = asyncio.run(run())
    assert end_of(events, "before")["type"] == "done"
    after = end_of(events, "after")
    assert after["type"] == "error" and after["status"] == 401, after


def test_the_in_flight_limit_refuses_with_429_and_keeps_the_connection(world: World) -> None:
    _, key = world.tenant_key()

    async def run() -> list[dict[str, Any]]:
        async with world.connect(key) as ws:
            for n in range(WS["max_in_flight"] + 1):
                await send(ws, f"r{n}", {**CHAT, "max_tokens": 64})
            return await until_end(ws, {f"r{n}" for n in range(WS["max_in_flight"] + 1)})

    events = asyncio.run(run())
    over = end_of(events, f"r{WS['max_in_flight']}")
    assert over["type"] == "error" and over["status"] == 429 and over["error"]["code"] == "too_many_in_flight"
    assert all(end_of(events, f"r{n}")["type"] == "done" for n in range(WS["max_in_flight"]))


def test_oversize_and_malformed_messages_are_error_events(world: World) -> None:
    tenant, key = world.tenant_key()

    async def run() -> list[dict[str, Any]]:
        async with world.connect(key) as ws:
            answers = []
            for message in ("x" * (WS["max_message_bytes"] + 1), "{not json", "[1]", json.dumps({"type": "completions"}),
                            json.dumps({"id": "t", "type": "embeddings", "body": {}}),
                            json.dumps({"id": "u", "type": "completions", "body": "text"}),
                            json.dumps({"id": "c", "type": "cancel"}),
                            json.dumps({"id": "v", "type": "completions", "body": {"model": MODEL}})):  # fmt: skip
                await ws.send(message)
                answers.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            await send(ws, "ok", CHAT)
            return answers + await until_end(ws, {"ok"})

    events = asyncio.run(run())
    wait_until(lambda: events[0]["request_id"] in world.events())
    audited = world.events()[events[0]["request_id"]]  # refused by the connection itself: on the trail too
    assert (audited["route"], audited["status"], audited["tenant_id"]) == ("WEBSOCKET /v1/websocket", 413, tenant.id)
    statuses = [(e["id"], e["status"], e["error"]["code"]) for e in events[:8]]
    assert statuses == [(None, 413, "request_too_large"), (None, 400, "invalid_json"), (None, 400, "invalid_json"),
                        (None, 400, "invalid_id"), ("t", 400, "unknown_type"), ("u", 400, None),
                        ("c", 400, "unknown_id"), ("v", 400, statuses[7][2])]  # fmt: skip
    assert end_of(events, "ok")["type"] == "done"


def test_a_cancel_ends_its_request_as_a_disconnect_does(world: World) -> None:
    _, key = world.tenant_key()

    async def run() -> list[dict[str, Any]]:
        async with world.connect(key) as ws:
            await send(ws, "long", LONG)
            await send(ws, "short", CHAT)
            events = [json.loads(await asyncio.wait_for(ws.recv(), 120))]
            while not any(e["id"] == "long" and e["type"] == "chunk" for e in events):
                events.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
            await ws.send(json.dumps({"id": "long", "type": "cancel"}))
            return events + await until_end(ws, {"long", "short"} - {e["id"] for e in events if e["type"] == "done"})

    events = asyncio.run(run())
    end = end_of(events, "long")
    assert end["type"] == "cancelled"
    assert len([e for e in events if e["id"] == "long" and e["type"] == "chunk"]) < LONG["max_tokens"]
    assert end_of(events, "short")["type"] == "done"
    world.settled()
    wait_until(lambda: end["request_id"] in world.events())
    assert world.events()[end["request_id"]]["status"] == 499


def test_a_client_gone_cancels_its_requests_as_an_http_client_leaving_does(world: World) -> None:
    tenant, key = world.tenant_key()

    async def run() -> None:
        async with world.connect(key) as ws:
            await send(ws, "long", LONG)
            while json.loads(await asyncio.wait_for(ws.recv(), 120))["type"] != "chunk":
                pass
        # the socket closed here, the request in flight

    started = time.monotonic()
    asyncio.run(run())
    wait_until(lambda: any(e["tenant_id"] == tenant.id for e in world.events().values()), timeout=60)
    [event] = [e for e in world.events().values() if e["tenant_id"] == tenant.id]
    assert event["route"] == "WEBSOCKET /v1/chat/completions" and event["status"] == 499
    assert event["completion_tokens"] < LONG["max_tokens"], "the request ran on after its client left"
    assert time.monotonic() - started < 60


def test_disabled_there_is_no_route(make_app: Any, tmp_path: Any) -> None:
    store = PolicyStore.open(StoreSettings(), tmp_path)
    try:
        app = make_app(store, data_dir=str(tmp_path), websocket={"enabled": False})
        assert not [r for r in app.routes if getattr(r, "path", None) == "/v1/websocket"]
        enabled = make_app(store, data_dir=str(tmp_path / "on"))
        assert [r for r in enabled.routes if getattr(r, "path", None) == "/v1/websocket"]
    finally:
        store.close()


@pytest.mark.serial  # the drain's close is timed against its grace
def test_a_drain_finishes_the_requests_then_closes_1001(make_app: Any, tmp_path: Any) -> None:
    store = PolicyStore.open(StoreSettings(), tmp_path)
    app = make_app(store, data_dir=str(tmp_path))
    server, thread, sock, url = start_uvicorn(app)
    try:
        world = World(store, url, tmp_path, app)
        _, key = world.tenant_key()
        loop = server.servers[0].get_loop()

        async def run() -> tuple[list[dict[str, Any]], int | None]:
            async with world.connect(key) as ws:
                await send(ws, "a", {**CHAT, "max_tokens": 48})
                first = json.loads(await asyncio.wait_for(ws.recv(), 120))
                loop.call_soon_threadsafe(app.state.drain.begin, 60.0)
                events = [first, *await until_end(ws, {"a"})]
                with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                    await asyncio.wait_for(ws.recv(), 30)
                return events, closed.value.rcvd.code if closed.value.rcvd else None

        started = time.monotonic()
        events, code = asyncio.run(run())
        assert end_of(events, "a")["type"] == "done" and text_of(events, "a")
        assert code == 1001
        assert time.monotonic() - started < 60, "the close waited for the grace, not for the requests"
    finally:
        stop_uvicorn(server, thread, sock)
        store.close()


# -- pings and the idle timeout: a server of their own, with short intervals

PING = 0.5
IDLE = 2.0  # after the ping's close (1011 at about twice PING), and told apart from it by its code


@pytest.fixture(scope="module")
def quick(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with open_live_world(World, make_app, tmp_path_factory.mktemp("websocket-quick"),
                         websocket={"ping_interval_seconds": PING, "idle_timeout_seconds": IDLE}) as world:  # fmt: skip
        yield world


def test_the_server_pings_and_drops_a_peer_that_never_answers(quick: World) -> None:
    """The library's sans-I/O client over a plain socket: it sees each frame, and its pongs are never sent."""
    _, key = quick.tenant_key()
    protocol = ClientProtocol(parse_uri(quick.ws_url))
    request = protocol.connect()
    request.headers["Authorization"] = f"Bearer {key}"
    protocol.send_request(request)
    host, port = quick.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"".join(protocol.data_to_send()))
        started, pings, closed_after = time.monotonic(), 0, None
        while closed_after is None and time.monotonic() - started < 10:
            data = sock.recv(65536)
            protocol.receive_data(data) if data else protocol.receive_eof()
            for event in protocol.events_received():
                if isinstance(event, Response):
                    assert event.status_code == 101
                elif isinstance(event, Frame) and event.opcode is Opcode.PING:
                    pings += 1
            protocol.data_to_send()  # the pongs the library queued: dropped, never sent
            if not data or protocol.close_rcvd is not None:
                closed_after = time.monotonic() - started
    assert pings >= 1, "the server sent no ping"
    close = protocol.close_rcvd  # uvicorn's keepalive: 1011 once a ping is unanswered for an interval
    assert closed_after is not None and close is not None, "a peer that never answered a ping stayed connected"
    assert close.code == 1011 and "ping" in close.reason, (close, closed_after)  # not the idle close's 1000


def test_an_idle_connection_is_closed_but_not_while_a_request_runs(quick: World) -> None:
    """A request runs for longer than the idle timeout (cancelled then, whatever the machine's speed): the
    connection stays; once it has ended and nothing more is sent, the connection is closed after the timeout."""
    _, key = quick.tenant_key()

    async def run() -> tuple[list[dict[str, Any]], Any, float]:
        async with quick.connect(key) as ws:
            await send(ws, "slow", {**CHAT, "max_tokens": 1000, "ignore_eos": True})  # within the tests' KV cache
            started, events = time.monotonic(), []
            while time.monotonic() - started < IDLE * 1.5:  # the request running, the client silent
                events.append(json.loads(await asyncio.wait_for(ws.recv(), IDLE * 10)))
                assert events[-1]["type"] == "chunk", events[-1]
            await ws.send(json.dumps({"id": "slow", "type": "cancel"}))
            events += await until_end(ws, {"slow"})
            ended = time.monotonic()
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), IDLE * 10)
            return events, closed.value.rcvd, time.monotonic() - ended

    events, close, quiet = asyncio.run(run())
    assert end_of(events, "slow")["type"] == "cancelled"
    assert close is not None and close.code == 1000 and close.reason == "idle timeout"
    assert IDLE - 0.5 <= quiet <= IDLE + 3, f"closed {quiet:.1f} s after the request ended (idle timeout {IDLE} s)"
