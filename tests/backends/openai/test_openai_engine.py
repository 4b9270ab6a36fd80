"""``RemoteEngine`` against the fake upstream on a real socket: a streaming client's choice is streamed
upstream, a client that takes its answer whole gets one unstreamed upstream request.

Which way the upstream was asked shows in the ``accept`` header it received
(``text/event-stream`` or ``application/json``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fake_upstream import FakeUpstream, running_fake_upstream
from upstream_rules import LOOPBACK

from inferflux.backends.engine import RequestOutput, SamplingParams
from inferflux.backends.openai.engine import RemoteEngine, _Decoder
from inferflux.backends.openai.errors import UpstreamFailed
from inferflux.backends.openai.fleet import FleetConfig
from inferflux.backends.openai.request import RemoteRequest

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeUpstream]:
    with running_fake_upstream("e") as served:
        yield served


@pytest.fixture
async def engine(fake: FakeUpstream) -> AsyncIterator[RemoteEngine]:
    fake.set(**FakeUpstream().knobs.__dict__)
    fake.reset_counters()
    config = FleetConfig(endpoints=(fake.url,), health_interval_seconds=0, idle_timeout_seconds=0.5,
                         timeout_seconds=10.0, routing="least_outstanding", retries=0, egress=LOOPBACK)  # fmt: skip
    remote = RemoteEngine(config, upstream_model="m")
    yield remote
    await remote.fleet.aclose()


def request(route: str = "chat", *, stream: bool, **body: Any) -> RemoteRequest:
    payload = {"messages": MESSAGES} if route == "chat" else {"prompt": "hello"}
    return RemoteRequest(request_id="r-0", route=route, body={"model": "m", **payload, **body},  # type: ignore[arg-type]
                         prompt_tokens=3, params=SamplingParams(), stream=stream)  # fmt: skip


async def outputs(engine: RemoteEngine, req: RemoteRequest) -> list[RequestOutput]:
    return [out async for out in engine.stream(req)]


@pytest.mark.parametrize("route", ["chat", "completion"])
async def test_a_whole_answer_is_one_unstreamed_request_and_one_finished_output(engine: RemoteEngine,
                                                                                fake: FakeUpstream, route: str) -> None:  # fmt: skip
    (out,) = await outputs(engine, request(route, stream=False, max_tokens=5))
    assert (out.new_text, out.finished, out.finish_reason) == ("Hello, this is a", True, "length")
    assert (out.prompt_tokens, out.completion_tokens) == (1, 5)  # the fake's own count (a word), not the estimate 3
    assert fake.headers[-1]["accept"] == "application/json"
    assert engine.stats().num_tokens_generated == 5 and engine.stats().num_running == 0


async def test_a_streamed_choice_is_streamed_upstream_one_output_per_chunk_as_they_come(
        engine: RemoteEngine, fake: FakeUpstream) -> None:  # fmt: skip
    fake.set(token_delay=0.05)  # slower than the gateway reads: each chunk in a read of its own
    outs = await outputs(engine, request(stream=True, max_tokens=5))
    assert [o.new_text for o in outs] == ["Hello", ",", " this", " is", " a", ""]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1]) and outs[-1].finish_reason == "length"
    assert outs[-1].completion_tokens == 5
    assert fake.headers[-1]["accept"] == "text/event-stream"


async def test_the_chunks_of_one_read_are_one_output() -> None:
    """An upstream that sends its whole answer in one write (here one body): one output for its text, with
    every chunk's logprobs, then the finish; no usage chunk, so a token per text chunk is charged."""
    from servers import start_uvicorn, stop_uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    def event(content: str | None, finish: str | None = None) -> bytes:
        delta = {"content": content} if content is not None else {}
        logprobs = {"content": [{"token": content, "logprob": -1.0, "top_logprobs": []}]} if content else None
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"

    body = event("") + event("Hi") + event(" there") + event("!") + event(None, "stop") + b"data: [DONE]\n\n"

    async def chat(_: Any) -> Response:
        return Response(body, media_type="text/event-stream")

    server, thread, sock, url = start_uvicorn(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]))
    remote = RemoteEngine(FleetConfig(endpoints=(url + "/v1",), health_interval_seconds=0, egress=LOOPBACK),
                          upstream_model="m")  # fmt: skip
    try:
        outs = await outputs(remote, request(stream=True))
    finally:
        await remote.fleet.aclose()
        await asyncio.to_thread(stop_uvicorn, server, thread, sock)
    assert [(o.new_text, o.finished) for o in outs] == [("Hi there!", False), ("", True)]
    assert [t.token for t in outs[0].logprobs or []] == ["Hi", " there", "!"]
    assert outs[-1].finish_reason == "stop" and outs[-1].completion_tokens == 3


async def test_a_whole_answer_waits_past_the_idle_timeout(engine: RemoteEngine, fake: FakeUpstream) -> None:
    """An upstream asked for a whole answer is silent until it is done: only timeout_seconds bounds the wait,
    while a stream silent for the idle timeout before its first byte is given up."""
    fake.set(header_delay=1.0)  # the idle timeout is 0.5 s
    (out,) = await outputs(engine, request(stream=False, max_tokens=2))
    assert out.new_text == "Hello," and out.finished
    with pytest.raises(UpstreamFailed, match="did not answer within 0.5 s"):
        await outputs(engine, request(stream=True, max_tokens=2))


def test_the_decoder_reads_a_whole_answer() -> None:
    def decoded(answer: dict[str, Any], route: str = "chat") -> RequestOutput:
        return _Decoder(request(route, stream=False)).whole(answer)

    logprobs = {"content": [{"token": "Hi", "logprob": -0.5, "top_logprobs": [{"token": "Hi", "logprob": -0.5}]}]}
    out = decoded({"choices": [{"message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop",
                                "logprobs": logprobs}], "usage": {"prompt_tokens": 9, "completion_tokens": 1}})
    assert (out.new_text, out.finish_reason, out.prompt_tokens, out.completion_tokens) == ("Hi", "stop", 9, 1)
    assert out.logprobs is not None and [(t.token, t.logprob) for t in out.logprobs] == [("Hi", -0.5)]
    # No usage: the estimate (the prompt's, a quarter of the characters); no reason: a complete answer stops.
    out = decoded({"choices": [{"text": "abcdefghij"}]}, "completion")
    assert (out.new_text, out.finish_reason, out.prompt_tokens, out.completion_tokens) == ("abcdefghij", "stop", 3, 3)
    assert decoded({"choices": [{"message": {"content": None}, "finish_reason": "tool_calls"}]}).new_text == ""
    for bad in ({}, {"choices": []}, {"choices": ["x"]}, {"choices": [{"message": {"content": 5}}]}):
        with pytest.raises(UpstreamFailed):
            decoded(bad)
