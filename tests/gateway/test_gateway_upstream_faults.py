"""A remote model's faults, seen by the gateway's clients: a killed endpoint, a stalled stream, a slow fleet.

The upstreams are fake OpenAI-compatible servers in their own processes
(``fake_upstream.FakeUpstreamProcess``), so kill -9 is real; the gateway runs
on a real socket and is called over HTTP, since what is under test is what
goes over the wire: an SSE stream that ends with an error event, a 503 with
Retry-After, nothing that hangs.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_upstream import FakeUpstreamProcess, running_fake_upstream
from http_helpers import bearer, error_of
from servers import start_uvicorn, stop_uvicorn
from upstream_rules import LOOPBACK

from inferflux.backends.base import ModelSpec
from inferflux.gateway.models.served import load_served_model
from inferflux.policy.store import PolicyStore, StoreSettings

pytestmark = pytest.mark.slow  # upstream processes, and 32 streams

STREAMS = 32


class Gateway:
    def __init__(self, url: str, key: str, model: Any) -> None:
        self.url, self.key, self.model = url, key, model

    def body(self, **extra: Any) -> dict[str, Any]:
        return {"model": "fleet", "messages": [{"role": "user", "content": "hi"}], **extra}


def serve(app_for_model: Any, tmp_path: Path, endpoints: list[str], **upstream: Any) -> Iterator[Gateway]:
    spec = ModelSpec(name="fleet", path="", upstream={"endpoints": endpoints, "model": "fake",
                                                      "health_interval_seconds": 0.2, **upstream})  # fmt: skip
    model = load_served_model(spec, "openai", egress=LOOPBACK)
    store = PolicyStore.open(StoreSettings(), tmp_path)
    key = str(store.ensure_bootstrap_admin())
    server, thread, sock, url = start_uvicorn(app_for_model(model, store, data_dir=str(tmp_path / "app")))
    try:
        yield Gateway(url, key, model)
    finally:
        model.shutdown()  # while the server's loop runs, as the app's shutdown does: the fleet's session closes in it
        stop_uvicorn(server, thread, sock)
        store.close()


async def read_stream(client: httpx.AsyncClient, gw: Gateway, **extra: Any) -> tuple[int, str, str | None, bool]:
    """(status, text, finish_reason, ended with an error event) of one streamed chat completion."""
    text, finish, errored = "", None, False
    async with client.stream("POST", f"{gw.url}/v1/chat/completions", headers=bearer(gw.key),
                             json=gw.body(stream=True, **extra)) as response:  # fmt: skip
        if response.status_code != 200:
            await response.aread()
            return response.status_code, "", None, False
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errored = True
                continue
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
    return 200, text, finish, errored


def test_kill_9_of_one_endpoint_under_32_streams(app_for_model: Any, tmp_path: Path) -> None:
    # Slow tokens: every stream is still running when one endpoint dies.
    with FakeUpstreamProcess(name="fake", token_delay=0.05) as a, FakeUpstreamProcess(name="fake", token_delay=0.05) as b:
        for gw in serve(app_for_model, tmp_path, [a.url, b.url], routing="least_outstanding", retries=2):

            async def run() -> list[tuple[int, str, str | None, bool]]:
                async with httpx.AsyncClient(timeout=60) as client:
                    streams = [asyncio.create_task(read_stream(client, gw, max_tokens=60)) for _ in range(STREAMS)]
                    await asyncio.sleep(1.0)
                    a.kill()
                    done = await asyncio.wait_for(asyncio.gather(*streams), timeout=60)
                    # Requests after the crash go to the survivor.
                    after = await asyncio.wait_for(
                        asyncio.gather(*(read_stream(client, gw, max_tokens=5) for _ in range(8))), timeout=60
                    )
                    return done + after

            started = time.monotonic()
            results = asyncio.run(run())
            assert time.monotonic() - started < 60
            during, after = results[:STREAMS], results[STREAMS:]
            cut = [r for r in during if r[3]]
            whole = [r for r in during if not r[3]]
            assert all(r[0] == 200 for r in during)
            assert cut, "no stream was on the killed endpoint"
            assert whole, "no stream survived on the other endpoint"
            assert all(r[2] == "length" for r in whole)  # the survivors finished normally
            assert all(r[2] is None for r in cut)  # a cut stream never claims to be finished
            assert all(r[:3] == (200, r[1], "length") and not r[3] for r in after)
            # The endpoint rejoins once it is back.
            a.start()
            deadline = time.monotonic() + 15
            while not all(s["healthy"] and s["circuit"] != "open" for s in gw.model.engine.describe()["endpoints"]):
                assert time.monotonic() < deadline, gw.model.engine.describe()
                time.sleep(0.1)
            before = a.state()["requests"].get("chat", 0)
            for _ in range(10):
                assert httpx.post(f"{gw.url}/v1/chat/completions", headers=bearer(gw.key), timeout=30,
                                  json=gw.body(max_tokens=2)).status_code == 200
            assert a.state()["requests"].get("chat", 0) > before  # it takes work again


def test_a_stalled_stream_is_cut_at_the_idle_timeout(app_for_model: Any, tmp_path: Path) -> None:
    with running_fake_upstream(name="fake", stall_after=3) as fake:
        for gw in serve(app_for_model, tmp_path, [fake.url], idle_timeout_seconds=1.0, retries=0):
            started = time.monotonic()
            status, text, finish, errored = asyncio.run(_one(gw))
            assert status == 200 and errored and finish is None
            assert text  # what came before the stall went out
            assert time.monotonic() - started < 10


async def _one(gw: Gateway, max_tokens: int = 20) -> tuple[int, str, str | None, bool]:
    async with httpx.AsyncClient(timeout=30) as client:
        return await read_stream(client, gw, max_tokens=max_tokens)


def test_a_whole_answer_is_asked_for_unstreamed_and_may_take_longer_than_the_idle_timeout(
        app_for_model: Any, tmp_path: Path) -> None:  # fmt: skip
    """A client that takes its answer whole gets one unstreamed upstream request (``accept: application/json``),
    whose silence until the generation is done is not a stall; a streaming client's request is streamed."""
    with running_fake_upstream(name="fake", header_delay=1.5) as fake:
        for gw in serve(app_for_model, tmp_path, [fake.url], idle_timeout_seconds=1.0, retries=0):
            whole = httpx.post(f"{gw.url}/v1/chat/completions", headers=bearer(gw.key), timeout=30,
                               json=gw.body(max_tokens=4))  # fmt: skip
            assert whole.status_code == 200, whole.text
            answer = whole.json()
            assert answer["choices"][0]["message"]["content"] == "Hello, this is"
            assert answer["choices"][0]["finish_reason"] == "length"
            assert answer["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}  # the fake's
            assert fake.headers[-1]["accept"] == "application/json" and fake.requests["chat"] == 1
            fake.set(header_delay=0.0)
            assert asyncio.run(_one(gw, max_tokens=4)) == (200, "Hello, this is", "length", False)
            assert fake.headers[-1]["accept"] == "text/event-stream"


def test_a_saturated_fleet_answers_503_at_once_instead_of_queueing(app_for_model: Any, tmp_path: Path) -> None:
    # A slow upstream with two slots: the third request must not wait for them.
    with running_fake_upstream(name="fake", token_delay=0.5) as fake:
        for gw in serve(app_for_model, tmp_path, [fake.url], max_inflight_per_endpoint=2, retries=0):

            async def run() -> tuple[list[Any], float, httpx.Response]:
                async with httpx.AsyncClient(timeout=60) as client:
                    slow = [asyncio.create_task(read_stream(client, gw, max_tokens=6)) for _ in range(2)]
                    await asyncio.sleep(0.5)
                    started = time.monotonic()
                    refused = await client.post(f"{gw.url}/v1/chat/completions", headers=bearer(gw.key),
                                                json=gw.body(max_tokens=2))  # fmt: skip
                    waited = time.monotonic() - started
                    return await asyncio.gather(*slow), waited, refused

            finished, waited, refused = asyncio.run(run())
            assert refused.status_code == 503 and error_of(refused)["code"] == "upstream_unavailable"
            assert int(refused.headers["retry-after"]) >= 1
            assert waited < 1.0  # refused at once, not queued behind the slow ones
            assert [r[2] for r in finished] == ["length", "length"]
            assert fake.url not in refused.text and "127.0.0.1" not in refused.text


def test_only_the_stored_key_and_allowed_headers_reach_the_upstream(app_for_model: Any, tmp_path: Path) -> None:
    with running_fake_upstream(name="fake") as fake:
        spec = ModelSpec(name="fleet", path="", upstream={"endpoints": [fake.url], "model": "fake"})
        model = load_served_model(spec, "openai", upstream_key="upstream-secret", egress=LOOPBACK)
        store = PolicyStore.open(StoreSettings(), tmp_path)
        key = str(store.ensure_bootstrap_admin())
        server, thread, sock, url = start_uvicorn(app_for_model(model, store, data_dir=str(tmp_path / "app")))
        try:
            traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            response = httpx.post(
                f"{url}/v1/chat/completions",
                headers={**bearer(key), "traceparent": traceparent, "x-secret-header": "mine", "cookie": "c=1"},
                json={"model": "fleet", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            )
            assert response.status_code == 200, response.text
            seen = {k.lower(): v for k, v in fake.headers[-1].items()}
            assert seen["authorization"] == "Bearer upstream-secret"
            assert seen["traceparent"] == traceparent
            assert "x-secret-header" not in seen and "cookie" not in seen
            assert key not in json.dumps(seen)
            # And nothing of the upstream's headers comes back.
            assert "x-fake-upstream" not in {k.lower() for k in response.headers}
        finally:
            model.shutdown()
            stop_uvicorn(server, thread, sock)
            store.close()
