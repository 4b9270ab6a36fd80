"""A fake OpenAI-compatible model server: the peer of the fleet tests and of the gateway benchmarks.

It answers ``POST /v1/chat/completions`` and ``POST /v1/completions``
(streamed or not, ``stream_options.include_usage`` honoured) and
``GET /v1/models`` with canned, deterministic tokens: token ``i`` of every
answer is ``TOKENS[i % len(TOKENS)]``, ``max_tokens`` of them when the request
says (finish ``length``), else ``DEFAULT_TOKENS`` (finish ``stop``).
``POST /v1/embeddings`` answers ``fake_embedding`` of each input, floats only. Nothing
sleeps unless a knob asks, so as a benchmark peer it costs little more than
the HTTP server itself.

Knobs (``Knobs``; set in the constructor, as attributes of ``.knobs``, through
``POST /_control`` with a JSON object of them, or as command-line flags):
``token_delay`` between chunks, ``header_delay`` before answering,
``stall_after`` N chunks (then silence until the client leaves, at most
``stall_seconds``), ``cut_after`` N chunks (then the connection is dropped
mid-body), ``fail_status`` for the next ``fail_count`` generation requests
(``fail_message`` in an OpenAI error body, or ``fail_text`` as a plain body),
``models_status`` for ``GET /v1/models``, ``json_stream`` (a JSON answer to a
streaming request), ``models`` (the names served; others get 404; empty:
any name).

Counters (``GET /_control``, or the attributes): requests by route, streams
active, completed and ended by a client that left (``disconnects``), and the
headers of the latest requests.

In-thread: ``with running_fake_upstream(name="a") as fake: fake.url``. As its
own process (so a test can kill -9 it): ``FakeUpstreamProcess(port)`` or
``python tests/support/fake_upstream.py --port N [--name A] [--token-delay S] ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

TOKENS = ("Hello", ",", " this", " is", " a", " fake", " upstream", " speaking", ".", " Tokens", " repeat", ";")
DEFAULT_TOKENS = 8
CREATED = 1_700_000_000


@dataclass
class Knobs:
    token_delay: float = 0.0
    header_delay: float = 0.0
    stall_after: int | None = None
    stall_seconds: float = 30.0
    cut_after: int | None = None
    fail_status: int = 500
    fail_count: int = 0
    fail_message: str = "the fake upstream failed on purpose"
    fail_text: str | None = None
    models_status: int = 200
    json_stream: bool = False
    models: list[str] = field(default_factory=list)


class _Cut(Exception):
    """Raised mid-body: uvicorn then drops the connection, as a crashed server would."""


class FakeUpstream:
    """The app's state: knobs to set, counters to read (from any thread)."""

    def __init__(self, name: str = "fake", **knobs: Any) -> None:
        self.name = name
        self.knobs = Knobs(**knobs)
        self.url = ""  # the base URL (…/v1) once served
        self.reset_counters()

    def reset_counters(self) -> None:
        self.requests: collections.Counter[str] = collections.Counter()
        self.headers: collections.deque[dict[str, str]] = collections.deque(maxlen=256)
        self.active = 0
        self.completed = 0
        self.disconnects = 0
        self._ids = 0

    def set(self, **knobs: Any) -> None:
        names = {f.name for f in fields(Knobs)}
        unknown = set(knobs) - names
        if unknown:
            raise ValueError(f"unknown knobs: {sorted(unknown)}")
        for name, value in knobs.items():
            setattr(self.knobs, name, value)

    def state(self) -> dict[str, Any]:
        return {"name": self.name, "requests": dict(self.requests), "active": self.active,
                "completed": self.completed, "disconnects": self.disconnects, "knobs": asdict(self.knobs),
                "headers": list(self.headers)}  # fmt: skip

    # -- the app

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, PlainTextResponse, Response
        from starlette.routing import Route

        async def refusal(route: str, request: Request) -> Response | None:
            """Count the request; the failure the knobs ask for, after their delay (None: answer it)."""
            self.requests[route] += 1
            self.headers.append(dict(request.headers))
            knobs = self.knobs
            if knobs.header_delay:
                await asyncio.sleep(knobs.header_delay)
            if knobs.fail_count > 0:
                knobs.fail_count -= 1
                if knobs.fail_text is not None:
                    return PlainTextResponse(knobs.fail_text, status_code=knobs.fail_status)
                return _error(knobs.fail_status, knobs.fail_message, "fake_failure")  # type: ignore[no-any-return]
            return None

        async def generate(request: Request) -> Any:
            route = "chat" if request.url.path.endswith("/chat/completions") else "completions"
            if (refused := await refusal(route, request)) is not None:
                return refused
            knobs = self.knobs
            try:
                body = json.loads(await request.body())
            except ValueError:
                return _error(400, "the body is not JSON", "invalid_json")
            if not isinstance(body, dict) or not isinstance(body.get("model"), str):
                return _error(400, "model is required", "missing_model", param="model")
            if knobs.models and body["model"] not in knobs.models:
                return _error(404, f"The model `{body['model']}` does not exist.", "model_not_found", param="model")
            field_name = "messages" if route == "chat" else "prompt"
            if field_name not in body:
                return _error(400, f"{field_name} is required", "missing_field", param=field_name)
            answer = _Answer(self, route, body)
            if body.get("stream") and not knobs.json_stream:
                return _EventStream(self, answer)
            return JSONResponse(answer.whole())

        async def embeddings(request: Request) -> Any:
            if (refused := await refusal("embeddings", request)) is not None:
                return refused
            body = json.loads(await request.body())
            inputs = body["input"] if isinstance(body["input"], list) and not isinstance(body["input"][0], int) \
                else [body["input"]]  # fmt: skip
            data = [{"object": "embedding", "index": i, "embedding": fake_embedding(item, self.name)}
                    for i, item in enumerate(inputs)]  # fmt: skip
            tokens = sum(len(item) if isinstance(item, list) else len(item.split()) for item in inputs)
            return JSONResponse({"object": "list", "data": data, "model": body["model"],
                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip

        async def models(request: Request) -> Response:
            self.requests["models"] += 1
            if self.knobs.models_status != 200:
                return _error(self.knobs.models_status, "models are unavailable", "fake_failure")
            names = self.knobs.models or ["fake-model"]
            return JSONResponse({"object": "list", "data": [
                {"id": name, "object": "model", "created": CREATED, "owned_by": self.name} for name in names]})

        async def control(request: Request) -> Response:
            if request.method == "POST":
                try:
                    self.set(**(await request.json()))
                except (ValueError, TypeError) as exc:
                    return _error(400, str(exc), "bad_knob")
            return JSONResponse(self.state())

        async def reset(request: Request) -> Response:
            self.reset_counters()
            return JSONResponse(self.state())

        return Starlette(routes=[
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/_control", control, methods=["GET", "POST"]),
            Route("/_control/reset", reset, methods=["POST"]),
        ])  # fmt: skip

    def next_id(self) -> int:
        self._ids += 1
        return self._ids


def fake_embedding(item: str | list[int], name: str) -> list[float]:
    """The fake's vector of one input: its length, its first character or token, and which fake answered."""
    first = (ord(item[0]) if item else 0) if isinstance(item, str) else item[0]
    return [float(len(item)), float(first), 0.5, float(len(name))]


def _error(status: int, message: str, code: str, param: str | None = None) -> Any:
    from starlette.responses import JSONResponse

    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)  # fmt: skip


def _prompt_tokens(route: str, body: dict[str, Any]) -> int:
    """Words in the prompt: a stand-in count, the same for the same prompt."""
    if route == "chat":
        texts = [m.get("content") for m in body.get("messages") or [] if isinstance(m, dict)]
        text = " ".join(t if isinstance(t, str) else json.dumps(t) for t in texts)
    else:
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    return max(1, len(text.split()))


class _Answer:
    """One request's canned answer, as chunks or whole."""

    def __init__(self, fake: FakeUpstream, route: str, body: dict[str, Any]) -> None:
        self.route = route
        self.model = body["model"]
        self.fingerprint = fake.name
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        self.count = limit if isinstance(limit, int) and limit >= 0 else DEFAULT_TOKENS
        self.finish = "length" if isinstance(limit, int) else "stop"
        self.prompt_tokens = _prompt_tokens(route, body)
        self.usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
        prefix = "chatcmpl" if route == "chat" else "cmpl"
        self.id = f"{prefix}-{fake.name}-{fake.next_id()}"
        self.object = "chat.completion.chunk" if route == "chat" else "text_completion"

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.count,
                "total_tokens": self.prompt_tokens + self.count}  # fmt: skip

    def text(self) -> str:
        return "".join(TOKENS[i % len(TOKENS)] for i in range(self.count))

    def whole(self) -> dict[str, Any]:
        if self.route == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": self.text()},
                                      "finish_reason": self.finish, "logprobs": None}  # fmt: skip
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": self.text(), "finish_reason": self.finish, "logprobs": None}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": CREATED, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": [choice], "usage": self.usage}  # fmt: skip

    def _chunk(self, choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> bytes:
        chunk: dict[str, Any] = {"id": self.id, "object": self.object, "created": CREATED, "model": self.model,
                                 "system_fingerprint": self.fingerprint, "choices": [choice] if choice else []}
        if usage is not None:
            chunk["usage"] = usage
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def chunks(self) -> Iterator[bytes]:
        """The SSE events: (a role chunk,) one per token, the finish, (the usage,) [DONE].

        A token's chunk is the same bytes as ``_chunk`` would make, spliced
        from two halves encoded once per answer and each token encoded once
        per process: a benchmark peer must not spend its time in ``json``.
        """
        chat = self.route == "chat"
        if chat:
            yield self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                               "logprobs": None})  # fmt: skip
        marker = "\x00"
        template = self._chunk({"index": 0, **({"delta": {"content": marker}} if chat else {"text": marker}),
                                "finish_reason": None, "logprobs": None})  # fmt: skip
        head, tail = template.split(json.dumps(marker).encode())
        for i in range(self.count):
            yield head + _ENCODED_TOKENS[i % len(TOKENS)] + tail
        end = {"delta": {}} if chat else {"text": ""}
        yield self._chunk({"index": 0, **end, "finish_reason": self.finish, "logprobs": None})
        if self.usage_wanted:
            yield self._chunk(None, self.usage)
        yield b"data: [DONE]\n\n"


_ENCODED_TOKENS = tuple(json.dumps(token).encode() for token in TOKENS)


class _EventStream:
    """An ASGI SSE response that notices a client leaving at any moment, even mid-stall.

    Starlette's StreamingResponse under ASGI 2.4 learns of a disconnect only
    when a write fails, so a stalled stream would never notice; here a
    listener waits for ``http.disconnect`` beside the writer and cancels it.
    """

    def __init__(self, fake: FakeUpstream, answer: _Answer) -> None:
        self.fake = fake
        self.answer = answer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        fake = self.fake
        knobs = fake.knobs
        if not (knobs.token_delay or knobs.stall_after is not None or knobs.cut_after is not None):
            # Nothing to wait for: the answer is written at once, without the listener's two tasks
            # (a benchmark peer's fast path; a client that leaves is seen as a failed write, if at all).
            fake.active += 1
            try:
                await self._write(send)
                fake.completed += 1
            finally:
                fake.active -= 1
            return
        fake.active += 1
        writer = asyncio.ensure_future(self._write(send))
        listener = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((writer, listener), return_when=asyncio.FIRST_COMPLETED)
            if not writer.done():
                writer.cancel()
                fake.disconnects += 1
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
            else:
                writer.result()  # a cut raises here, and uvicorn drops the connection
                fake.completed += 1
        finally:
            fake.active -= 1
            listener.cancel()
            writer.cancel()

    async def _write(self, send: Any) -> None:
        knobs = self.fake.knobs
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})  # fmt: skip
        for sent, event in enumerate(self.answer.chunks()):
            if knobs.stall_after is not None and sent == knobs.stall_after:
                await asyncio.sleep(knobs.stall_seconds)
                raise _Cut("stalled past stall_seconds")
            if knobs.cut_after is not None and sent == knobs.cut_after:
                raise _Cut("cut on purpose")
            if knobs.token_delay and sent:
                await asyncio.sleep(knobs.token_delay)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# -- serving it


@contextlib.contextmanager
def running_fake_upstream(name: str = "fake", **knobs: Any) -> Iterator[FakeUpstream]:
    """A fake upstream served in a thread on a free loopback port; ``fake.url`` is its base URL (…/v1)."""
    from servers import start_uvicorn, stop_uvicorn

    fake = FakeUpstream(name, **knobs)
    server, thread, sock, url = start_uvicorn(fake.app())
    server.config.timeout_graceful_shutdown = 2  # streams left stalled by a failed test must not hold the stop
    fake.url = url + "/v1"
    try:
        yield fake
    finally:
        stop_uvicorn(server, thread, sock)


def free_port() -> int:
    """A loopback port free now (another process may take it before it is used: good enough for tests)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class FakeUpstreamProcess:
    """The fake as a child process on a fixed port, so it can be killed with SIGKILL and started again there."""

    def __init__(self, port: int | None = None, name: str = "fake", **knobs: Any) -> None:
        self.port = port or free_port()
        self.name = name
        self.knobs = knobs
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> FakeUpstreamProcess:
        args = [sys.executable, str(Path(__file__).resolve()), "--port", str(self.port), "--name", self.name]
        for name, value in self.knobs.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"the fake upstream {self.name} exited with {self.process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/models", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"the fake upstream {self.name} did not start within {timeout} s")

    def state(self) -> dict[str, Any]:
        import httpx

        return dict(httpx.get(f"http://127.0.0.1:{self.port}/_control", timeout=5.0).json())

    def kill(self) -> None:
        """SIGKILL: no goodbye to its clients, as a crashed or OOM-killed server."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> FakeUpstreamProcess:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A fake OpenAI-compatible upstream (tests, benchmarks).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--header-delay", type=float, default=0.0)
    parser.add_argument("--stall-after", type=int, default=None)
    parser.add_argument("--stall-seconds", type=float, default=30.0)
    parser.add_argument("--cut-after", type=int, default=None)
    parser.add_argument("--models", default="", help="comma-separated names served (default: any)")
    args = parser.parse_args(argv)
    import uvicorn

    fake = FakeUpstream(
        args.name, token_delay=args.token_delay, header_delay=args.header_delay, stall_after=args.stall_after,
        stall_seconds=args.stall_seconds, cut_after=args.cut_after, models=[m for m in args.models.split(",") if m],
    )  # fmt: skip
    uvicorn.run(fake.app(), host=args.host, port=args.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=2)  # fmt: skip


if __name__ == "__main__":
    main()
