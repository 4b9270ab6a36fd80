"""``RemoteEngine``: a served model whose tokens come from an upstream fleet.

It stands where an ``AsyncEngine`` stands for a local model (``make_request``
is the plan's, ``stream`` yields ``RequestOutput`` deltas, ``stats`` feeds
admission and metrics), so the gateway's policy chain, renderers and audit run
the same way whichever kind of backend is behind a model.

Each choice is one upstream request. For a client that streams, it is streamed
(``stream_options.include_usage`` on): text goes out as the upstream sends it,
one output for the chunks of each network read (one chunk each from an upstream
that generates slower than the gateway reads; several from a fast one or after
a pause, which then cost one step downstream instead of one each). For a client that takes its answer whole
(``RemoteRequest.stream`` false) it is asked for unstreamed, and its one JSON
answer becomes one finished output: one body to parse instead of an event per
token, each decoded, queued, checked by the output guardrails and rendered
(the output guardrails check the whole text once, which decides as the
chunk-by-chunk check does). The upstream's ``usage`` settles the request's
tokens; an upstream that sends none is charged an estimate (the prompt's, and
one token per text chunk or a quarter of the characters, whichever is more),
so a quota is never free to bypass.

``embed`` forwards an embeddings request to the fleet's ``/embeddings`` in one
non-streamed POST (no prefix affinity: there is no cache to meet) and checks
the answer's shape before the gateway encodes it as the client asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from inferflux.backends.engine import EmbeddingResult, EngineStats, RequestOutput, TokenLogprob
from inferflux.backends.openai.errors import UpstreamFailed
from inferflux.backends.openai.fleet import Fleet, FleetConfig
from inferflux.backends.openai.request import RemoteEmbeddingRequest, RemoteRequest, estimate_tokens

ROUTES = {"chat": "/chat/completions", "completion": "/completions"}
# Upstreams stream deltas; vLLM, llama.cpp, SGLang and TGI name a finished choice with these.
FINISH_REASONS = {"stop", "length", "content_filter", "tool_calls", "function_call"}


class RemoteEngine:
    """The engine-shaped face of one upstream model on a ``Fleet``."""

    def __init__(self, config: FleetConfig, *, upstream_model: str, max_model_len: int = 0) -> None:
        self.config = config
        self.upstream_model = upstream_model
        self._max_model_len = max_model_len
        self.fleet = Fleet(config)
        self._lock = threading.Lock()
        self._started: asyncio.AbstractEventLoop | None = None
        self._running = 0
        self._finished_tokens = 0
        self._steps = 0

    speculative = None  # an upstream's own speculation is its business

    # -- lifecycle (the gateway's event loop owns the fleet's connections)

    async def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._started is loop:
            return
        with self._lock:
            first = self._started is None
            self._started = loop
        if first:
            await self.fleet.start()

    def start(self) -> None:
        """Nothing to start eagerly: the fleet starts on the first request, in the serving loop."""

    def shutdown(self) -> None:
        """Close the fleet's connections and its health checks (from any thread)."""
        loop = self._started
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            task = loop.create_task(self.fleet.aclose())
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
        elif loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self.fleet.aclose(), loop).result(timeout=5)

    @property
    def is_running(self) -> bool:
        return True

    def set_api_key(self, api_key: str | None) -> None:
        """The upstream's key changed (a rotated credential): used from the next request on."""
        self.fleet.set_api_key(api_key)

    # -- the gateway's side

    def describe(self) -> dict[str, Any]:
        """Where the model is served from and how each endpoint is doing (no key)."""
        return {
            "model": self.upstream_model,
            "routing": self.config.routing,
            "endpoints": [_public(status) for status in self.fleet.statuses()],
        }

    def stats(self) -> EngineStats:
        # Nothing waits here: the fleet refuses at once when every endpoint is full.
        return EngineStats(
            num_running=self._running,
            num_waiting=0,
            num_blocks_used=0,
            num_blocks_free=0,
            num_blocks_total=0,
            block_size=0,
            num_preemptions=0,
            num_tokens_processed=0,
            num_tokens_generated=self._finished_tokens,
            num_steps=self._steps,
            max_num_seqs=self.config.max_inflight_per_endpoint * len(self.config.endpoints),
            max_model_len=self._max_model_len,
        )

    async def stream(self, request: RemoteRequest) -> AsyncIterator[RequestOutput]:
        """The upstream's answer for one choice, as deltas; the last has ``finished=True``.

        Raises the fleet's ``UpstreamError``s. Closing the generator early
        closes the upstream request, which is how the upstream learns to stop.
        """
        await self._ensure_started()
        decoder = _Decoder(request)
        route = ROUTES[request.route]
        self._running += 1
        try:
            if request.stream:
                body = {**request.body, "stream": True, "stream_options": {"include_usage": True}}
                reads = self.fleet.reads(route, body, affinity=request.affinity, headers=request.headers)
                async with contextlib.aclosing(reads):
                    async for chunks in reads:
                        out = decoder.feed(chunks)
                        if out is not None:
                            yield out
                # The usage chunk (or the end of the stream) ends the choice.
                yield decoder.finish()
            else:
                # Silent until the whole generation is done: no idle timeout, only timeout_seconds.
                answer = await self.fleet.post(route, {**request.body, "stream": False}, affinity=request.affinity,
                                               headers=request.headers, patient=True, key="choices")  # fmt: skip
                yield decoder.whole(answer)
            self._finished_tokens += decoder.completion_tokens
        finally:
            self._running -= 1
            self._steps += 1


    async def embed(self, request: RemoteEmbeddingRequest) -> EmbeddingResult:
        """The upstream's embeddings of the request's inputs, in input order, and its count of their tokens.

        Raises the fleet's ``UpstreamError``s; ``UpstreamFailed`` for an answer
        that is not one vector of numbers per input, all of one length.
        """
        await self._ensure_started()
        self._running += 1
        try:
            answer = await self.fleet.post("/embeddings", request.body, headers=request.headers)
        finally:
            self._running -= 1
            self._steps += 1
        return embedding_result(answer, request)


def embedding_result(answer: dict[str, Any], request: RemoteEmbeddingRequest) -> EmbeddingResult:
    """An upstream's embeddings answer as the engine's result; UpstreamFailed when it is malformed."""
    data = answer.get("data")
    if not isinstance(data, list) or len(data) != request.num_inputs:
        raise UpstreamFailed(f"the upstream answered {len(data) if isinstance(data, list) else 'no'} embeddings "
                             f"for {request.num_inputs} inputs")  # fmt: skip
    rows: dict[int, Any] = {}
    for position, item in enumerate(data):
        index = item.get("index", position) if isinstance(item, dict) else None
        vector = item.get("embedding") if isinstance(item, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not isinstance(vector, list) or index in rows:
            raise UpstreamFailed("the upstream sent a malformed embeddings answer")
        rows[index] = vector
    if sorted(rows) != list(range(request.num_inputs)):
        raise UpstreamFailed("the upstream sent a malformed embeddings answer")
    try:
        vectors = np.array([rows[i] for i in range(request.num_inputs)], dtype=np.float32)
    except (TypeError, ValueError):  # not numbers, or rows of different lengths
        raise UpstreamFailed("the upstream sent a malformed embeddings answer") from None
    if vectors.ndim != 2 or vectors.shape[1] == 0 or not np.isfinite(vectors).all():
        raise UpstreamFailed("the upstream sent a malformed embeddings answer")
    usage = answer.get("usage")
    counted = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    valid = isinstance(counted, int) and not isinstance(counted, bool) and counted >= 0
    return EmbeddingResult(vectors, counted if valid else request.prompt_tokens)  # type: ignore[arg-type]


def _public(status: Any) -> dict[str, Any]:
    fields = getattr(status, "__dataclass_fields__", None)
    return {name: getattr(status, name) for name in fields} if fields else dict(status)


class _Decoder:
    """Upstream stream chunks → ``RequestOutput`` deltas for one choice."""

    def __init__(self, request: RemoteRequest) -> None:
        self.request = request
        self.prompt_tokens = request.prompt_tokens
        self.text_chunks = 0
        self.chars = 0
        self.reported: int | None = None  # the upstream's completion count, once it says
        self.finish_reason: str | None = None

    @property
    def completion_tokens(self) -> int:
        if self.reported is not None:
            return self.reported
        return max(self.text_chunks, math.ceil(self.chars / 4))

    def feed(self, chunks: list[dict[str, Any]]) -> RequestOutput | None:
        """The delta of the stream chunks that came in one read, as one output (None when none has text:
        role, finish or usage only): one step downstream (queue, guardrails, an SSE chunk) per read."""
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        for chunk in chunks:
            self._usage(chunk.get("usage"))
            choices = chunk.get("choices")
            if not isinstance(choices, list) or not choices:
                continue
            text, entries = self._choice(choices[0], "delta", "stream chunk")
            if text or entries:  # a role-only or finish-only chunk is not counted: the finish goes out with ``finish``
                self.text_chunks += 1
                self.chars += len(text)
                texts.append(text)
                logprobs += entries or ()
        if not texts:
            return None
        return self._output("".join(texts), finished=False, logprobs=logprobs or None)

    def finish(self) -> RequestOutput:
        if self.finish_reason is None:
            # A stream that ends without saying why was cut: the client must not take it for a whole answer.
            raise UpstreamFailed("the upstream ended the stream before the answer was finished")
        return self._output("", finished=True, reason=self.finish_reason)

    def whole(self, answer: dict[str, Any]) -> RequestOutput:
        """An unstreamed answer as one finished output: all its text, logprobs and finish reason."""
        self._usage(answer.get("usage"))
        choices = answer.get("choices")
        if not isinstance(choices, list) or not choices:
            raise UpstreamFailed("the upstream sent an answer without choices")
        text, logprobs = self._choice(choices[0], "message", "answer")
        if text:
            self.text_chunks = 1
            self.chars = len(text)
        # The body was read to its end, so a missing reason is not a cut: the answer is complete.
        return self._output(text, finished=True, reason=self.finish_reason or "stop", logprobs=logprobs)

    def _usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and prompt >= 0:
                self.prompt_tokens = prompt
            if isinstance(completion, int) and completion >= 0:
                self.reported = completion

    def _choice(self, choice: Any, field: str, what: str) -> tuple[str, list[TokenLogprob] | None]:
        """A choice's text (chat: in ``field``, ``delta`` or ``message``) and logprobs; notes its finish reason."""
        if not isinstance(choice, dict):
            raise UpstreamFailed(f"the upstream sent a malformed {what}")
        text = _text(self.request.route, choice, field, what)
        reason = choice.get("finish_reason")
        if reason is not None:
            self.finish_reason = reason if reason in FINISH_REASONS else "stop"
        return text, _logprobs(choice.get("logprobs"))

    def _output(
        self, text: str, *, finished: bool, reason: str | None = None, logprobs: list[TokenLogprob] | None = None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=self.request.request_id,
            new_token_ids=[],
            new_text=text,
            finished=finished,
            finish_reason=reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            logprobs=logprobs,
        )


def _text(route: str, choice: dict[str, Any], field: str, what: str) -> str:
    if route == "completion":
        text = choice.get("text")
    else:
        message = choice.get(field)
        text = message.get("content") if isinstance(message, dict) else None
    if text is None:
        return ""
    if not isinstance(text, str):
        raise UpstreamFailed(f"the upstream sent a malformed {what}")
    return text


def _logprobs(raw: Any) -> list[TokenLogprob] | None:
    """A chat chunk's ``logprobs.content`` as the engine's records (token ids unknown: -1)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("content"), list):
        return None
    entries: list[TokenLogprob] = []
    for item in raw["content"]:
        if not isinstance(item, dict) or not isinstance(item.get("token"), str):
            raise UpstreamFailed("the upstream sent malformed logprobs")
        top = [
            (-1, t["token"], float(t["logprob"]))
            for t in item.get("top_logprobs") or []
            if isinstance(t, dict) and isinstance(t.get("token"), str) and isinstance(t.get("logprob"), int | float)
        ]
        value = item.get("logprob")
        if not isinstance(value, int | float):
            raise UpstreamFailed("the upstream sent malformed logprobs")
        entries.append(TokenLogprob(token_id=-1, token=item["token"], logprob=float(value), top=top))
    return entries or None
