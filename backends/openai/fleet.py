"""The client of one model's upstream fleet: OpenAI-compatible servers behind one name.

One ``Fleet`` per served model. It sends through one pooled keep-alive HTTP
session for all the model's endpoints (``transport.py``: the connections,
TLS, timeouts per phase) and decides, per request, where it goes and what to
do when that fails:

- **Placement** (``routing.py``): least outstanding requests, or, with
  ``routing="prefix"`` and an affinity key, the key's endpoint on a
  consistent-hash ring with bounded load, so a shared prompt prefix meets the
  same upstream prefix cache.
- **Health** (``health.py``): an endpoint is used while its active check
  (``GET {base}/models`` every ``health_interval_seconds``) gets an answer,
  its circuit breaker is closed (or half-open, for one probe) and it is under
  ``max_inflight_per_endpoint``.
- **Backpressure**: when no endpoint can take a request it is refused at once
  (``UpstreamUnavailable`` with a Retry-After), never queued: a gateway that
  queued for a saturated fleet would hold client connections until they all
  timed out together.
- **Retries and failover** only before the first byte of the answer's body:
  until then the upstream has produced nothing the client saw, so another
  endpoint can answer instead; after it, a retry would repeat or fork a
  generation the client is already reading, so the failure is the client's to
  see (``UpstreamFailed``).
- **Streams** are passed through event by event as they arrive; closing the
  iterator closes the upstream connection, which is how a vLLM or llama.cpp
  server learns to stop generating for a client that left. A request whose
  answer is one JSON object (``post``: embeddings, and a generation a client
  asked for unstreamed) takes the same placement, retries and failover; its
  answer is read whole, up to ``MAX_JSON_ANSWER``. After ``[DONE]`` the body
  is read to its end (``DRAIN_SECONDS`` at most) so that its connection goes
  back to the pool.
- **Errors** become the four kinds of ``errors.py``, with scrubbed messages.
  Only the fleet's own headers, the api key and the caller's allowed headers
  go upstream; the upstream's response headers stay here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp.abc import AbstractResolver

from inferflux.backends.openai.config import FleetConfig
from inferflux.backends.openai.errors import (
    Scrubber,
    UpstreamError,
    UpstreamFailed,
    UpstreamUnavailable,
    error_from_answer,
    error_in_stream,
    retry_after_seconds,
)
from inferflux.backends.openai.health import EndpointState, EndpointStatus, check, retry_after
from inferflux.backends.openai.routing import LeastOutstanding, PrefixRing
from inferflux.backends.openai.sse import EventReader
from inferflux.backends.openai.transport import (
    Answer,
    ConnectFailed,
    ConnectionLost,
    DeadlinePassed,
    Outgoing,
    TimedOut,
    Transport,
)

__all__ = ["EndpointStatus", "Fleet", "FleetConfig"]

BACKOFF_BASE_SECONDS = 0.05  # the first retry waits up to this (full jitter), each next one up to twice as long
BACKOFF_CAP_SECONDS = 1.0
MAX_ERROR_BODY = 64 * 1024  # what is read of a non-2xx answer to find its error message
DRAIN_SECONDS = 0.1  # how long the end of a body is awaited after [DONE] (then the connection is closed)
DRAIN_READS = 4
# The largest JSON answer ``post`` reads: 2048 embeddings of 4096 floats written out in full
# (about 20 characters each) take ~170 MB; more is a broken upstream, not an answer.
MAX_JSON_ANSWER = 256 * 1024 * 1024


class _Retry(Exception):
    """An attempt failed before the first body byte; ``error`` is what the client gets if it was the last."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class _Opened:
    """An attempt that got past the first body byte: the answer's state from there on."""

    index: int
    probe: bool
    answer: Answer
    first: bytes


class Fleet:
    """Sends requests to one model's endpoints; see the module docstring for the policy.

    Used from one event loop (the gateway's). ``clock`` drives the circuit
    breakers only (tests pass a fake one); timeouts run on real time.
    ``resolver`` looks host names up (default: aiohttp's getaddrinfo; a test
    passes one standing for DNS), under ``config.egress``'s check. The
    client (``transport.py``) reads nothing from the environment (no proxy
    variables, no ``.netrc``): where requests go and what credential they
    carry is the configuration's alone.
    """

    def __init__(self, config: FleetConfig, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, resolver: AbstractResolver | None = None) -> None:  # fmt: skip
        self.config = config
        self._rng = rng or random.Random()
        self._endpoints = [
            EndpointState(url, cap=config.max_inflight_per_endpoint, breaker_failures=config.breaker_failures,
                          breaker_reset_seconds=config.breaker_reset_seconds, clock=clock)  # fmt: skip
            for url in config.endpoints
        ]
        self._least = LeastOutstanding(self._endpoints)
        self._ring = PrefixRing(self._endpoints) if config.routing == "prefix" else None
        self._keys_held: set[str] = {config.api_key} if config.api_key else set()
        self._scrub = Scrubber(self._keys_held, config.endpoints)
        # Every endpoint's cap, plus one connection each for the health check.
        slots = len(self._endpoints) * (config.max_inflight_per_endpoint + 1)
        self._transport = Transport(slots=slots, connect_seconds=config.connect_timeout_seconds,
                                    idle_seconds=config.idle_seconds, ca_file=config.ca_file,
                                    api_key=config.api_key, egress=config.egress, resolver=resolver)  # fmt: skip
        self._health_task: asyncio.Task[None] | None = None
        self._closed = False

    # -- lifecycle

    async def start(self) -> None:
        """Start the active health check (when configured); calling it again does nothing."""
        if self._closed or self.config.health_interval_seconds <= 0:
            return
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop(), name="fleet-health")

    async def aclose(self) -> None:
        """Stop the health check and close every pooled connection; later requests are refused."""
        self._closed = True
        task, self._health_task = self._health_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():  # our own caller was cancelled, not just the task
                    raise
        await self._transport.aclose()

    def set_api_key(self, api_key: str | None) -> None:
        """A rotated key, sent from the next request on; every key this fleet has held stays scrubbed."""
        if api_key:
            self._keys_held.add(api_key)
        self._transport.set_api_key(api_key)
        self._scrub = Scrubber(self._keys_held, self.config.endpoints)

    def statuses(self) -> list[EndpointStatus]:
        """Each endpoint's state and counters, in configuration order."""
        return [endpoint.status() for endpoint in self._endpoints]

    # -- requests

    async def stream(self, path: str, body: Mapping[str, Any], *, affinity: bytes | None = None,
                     headers: Mapping[str, str] | None = None) -> AsyncGenerator[dict[str, Any], None]:  # fmt: skip
        """Each event's JSON object, one at a time: ``reads`` without the grouping."""
        reads = self.reads(path, body, affinity=affinity, headers=headers)
        async with contextlib.aclosing(reads):
            async for events in reads:
                for event in events:
                    yield event

    async def reads(self, path: str, body: Mapping[str, Any], *, affinity: bytes | None = None,
                    headers: Mapping[str, str] | None = None) -> AsyncGenerator[list[dict[str, Any]], None]:  # fmt: skip
        """POST ``body`` (the caller sets ``"stream": true``) to base + ``path``; yield the JSON objects of
        the events that came in each network read, in order (never an empty list).

        An upstream that outpaces its reader (a fast one, or a burst after a
        pause) delivers several events in one read: the caller handles them
        as one step instead of one step each. Ends at ``data: [DONE]`` or at
        the end of the body. Raises ``UpstreamUnavailable`` before anything
        is sent when no endpoint can take the request, ``UpstreamRejected``
        for a 4xx, ``UpstreamFailed`` otherwise (after yielding the events
        that came before the failure). Closing the generator early
        (``aclose``, cancelling the task that reads it) closes the upstream
        connection at once. ``headers`` are sent as given (the caller's
        allow-list), except the ones the fleet sets itself.
        """
        if self._closed:
            raise UpstreamUnavailable("the upstream fleet is closed", retry_after=1.0)
        request = Outgoing.of(path, body, headers, "text/event-stream")
        deadline = time.monotonic() + self.config.timeout_seconds
        opened = await self._open(request, affinity, deadline)
        reader = EventReader()
        async with self._reading(opened, "stream cut", "mid-stream") as endpoint:
            raw: bytes | None = opened.first
            while True:
                done = raw is None
                events: list[dict[str, Any]] = []
                failure: UpstreamError | None = None
                for data in reader.feed(raw) if raw is not None else reader.close():
                    if data == b"[DONE]":
                        done = True
                        break
                    try:
                        events.append(self._event(data, endpoint))
                    except UpstreamError as exc:  # what came before it in this read still goes out
                        failure = exc
                        break
                if events:
                    yield events
                if failure is not None:
                    raise failure
                if done:
                    if raw is not None:  # [DONE] before the body's end: read on to it, for the pool
                        await opened.answer.drain(DRAIN_SECONDS, DRAIN_READS)
                    return
                raw = await opened.answer.read(deadline)

    async def post(self, path: str, body: Mapping[str, Any], *, affinity: bytes | None = None,
                   headers: Mapping[str, str] | None = None, patient: bool = False,
                   key: str = "data") -> dict[str, Any]:  # fmt: skip
        """POST ``body`` to base + ``path`` and return the JSON object it answers.

        Placement, retries before the first byte, errors and headers as for
        ``stream``; the answer is read whole (up to ``MAX_JSON_ANSWER`` bytes),
        within ``timeout_seconds``, and must be a JSON object. ``patient``: the
        upstream works before it answers (a generation not streamed), so no
        idle timeout bounds the wait for it, only ``timeout_seconds``. ``key``: the
        field every answer of ``path`` has (``data`` for embeddings, ``choices`` for a
        generation); an ``error`` without it is the upstream's failure.
        """
        if self._closed:
            raise UpstreamUnavailable("the upstream fleet is closed", retry_after=1.0)
        request = Outgoing.of(path, body, headers, "application/json", patient)
        deadline = time.monotonic() + self.config.timeout_seconds
        opened = await self._open(request, affinity, deadline)
        parts, size = [opened.first], len(opened.first)
        async with self._reading(opened, "answer cut", "mid-answer") as endpoint:
            while (raw := await opened.answer.read(deadline)) is not None:
                size += len(raw)
                if size > MAX_JSON_ANSWER:
                    endpoint.failed("answer too large")
                    raise UpstreamFailed(f"the upstream's answer is larger than {MAX_JSON_ANSWER // 2**20} MiB")
                parts.append(raw)
        return self._json_object(b"".join(parts), endpoint, "an answer", key, "in its answer")

    @contextlib.asynccontextmanager
    async def _reading(self, opened: _Opened, cut: str, where: str) -> AsyncIterator[EndpointState]:
        """While an opened answer's body is read: its failures as the caller's errors (``cut``: the
        endpoint's last error for a lost connection; ``where``: the message's), the endpoint released after."""
        endpoint = self._endpoints[opened.index]
        try:
            yield endpoint
        except TimedOut:
            endpoint.failed("stalled")
            raise UpstreamFailed(f"the upstream sent nothing for {self.config.idle_seconds:g} s") from None
        except ConnectionLost:
            endpoint.failed(cut)
            raise UpstreamFailed(f"the upstream connection was lost {where}") from None
        except DeadlinePassed:
            raise UpstreamFailed(f"the upstream did not finish within {self.config.timeout_seconds:g} s") from None
        finally:
            endpoint.release(opened.probe)
            opened.answer.close()

    async def _open(self, request: Outgoing, affinity: bytes | None, deadline: float) -> _Opened:
        """Attempts, with failover and back-off, until one gets past its first body byte."""
        tried: set[int] = set()
        last: UpstreamError | None = None
        for attempt in range(self.config.retries + 1):
            if attempt:
                pause = self._rng.uniform(0, min(BACKOFF_CAP_SECONDS, BACKOFF_BASE_SECONDS * 2 ** (attempt - 1)))
                if time.monotonic() + pause >= deadline:
                    break
                await asyncio.sleep(pause)
            index = self._choose(affinity, frozenset(tried))
            if index is None:
                break
            tried.add(index)
            try:
                return await self._attempt(index, request, deadline)
            except _Retry as retry:
                last = retry.error
        if last is None:
            raise UpstreamUnavailable("no upstream endpoint can take the request now",
                                      retry_after=retry_after(self._endpoints))
        if isinstance(last, UpstreamUnavailable):  # the endpoints' state may have moved since
            last.retry_after = max(last.retry_after, retry_after(self._endpoints))
        raise last

    def _choose(self, affinity: bytes | None, tried: frozenset[int]) -> int | None:
        """An endpoint not tried yet for this request, else any available one (a fleet of one retries itself)."""
        for exclude in (tried, frozenset()) if tried else (tried,):
            if self._ring is not None and affinity is not None:
                index = self._ring.pick(affinity, exclude)
            else:
                index = self._least.pick(exclude)
            if index is not None:
                return index
        return None

    async def _attempt(self, index: int, request: Outgoing, deadline: float) -> _Opened:
        """One try on one endpoint; raises ``_Retry`` for what another try may fix, the final error otherwise."""
        endpoint = self._endpoints[index]
        probe = endpoint.acquire()
        answer: Answer | None = None
        try:
            try:
                answer = await self._transport.send(endpoint.url + request.path, request, deadline)
                status = answer.status
                if status < 200 or status >= 300:
                    raise self._refusal(endpoint, answer, await answer.start(MAX_ERROR_BODY, deadline))
                if answer.media != request.media:
                    streamed = request.media == "text/event-stream"
                    endpoint.failed("not a stream" if streamed else "not JSON")
                    raise UpstreamFailed("the upstream answered without streaming" if streamed
                                         else "the upstream's answer is not JSON")  # fmt: skip
                endpoint.succeeded()
                first = await answer.read(deadline)
            except ConnectFailed:
                endpoint.failed("connect error")
                raise _Retry(UpstreamUnavailable("no upstream endpoint could be reached", retry_after=1.0)) from None
            except TimedOut:
                endpoint.failed("timed out")
                raise _Retry(UpstreamFailed(f"the upstream did not answer within {self.config.idle_seconds:g} s"))
            except ConnectionLost:
                endpoint.failed("connection error")
                raise _Retry(UpstreamFailed("the upstream connection failed before its answer")) from None
            except DeadlinePassed:
                raise UpstreamFailed(f"the upstream did not answer within {self.config.timeout_seconds:g} s") from None
            if first is None:
                endpoint.failed("empty stream")
                raise _Retry(UpstreamFailed("the upstream closed the stream without sending anything"))
            return _Opened(index, probe, answer, first)
        except BaseException:
            endpoint.release(probe)
            if answer is not None:
                answer.close()
            raise

    def _refusal(self, endpoint: EndpointState, answer: Answer, start: bytes) -> Exception:
        """What a non-2xx answer means: ``_Retry`` for a busy or failing endpoint, the error itself for a 4xx."""
        status = answer.status
        if status == 429:  # busy, not broken: try another, and say when to come back if all are
            wait = retry_after_seconds(answer.retry_after)
            return _Retry(UpstreamUnavailable("the upstream is busy", retry_after=wait))
        if 400 <= status < 500 and status != 408:
            endpoint.succeeded()  # it answered: the request (or our credential), not the endpoint, is at fault
            return error_from_answer(status, start, self._scrub)
        # 5xx, a timeout of its own, or a redirect (never followed: it could lead the api key elsewhere).
        endpoint.failed(f"HTTP {status}")
        return _Retry(UpstreamFailed(f"the upstream failed (HTTP {status})"))

    def _event(self, data: bytes, endpoint: EndpointState) -> dict[str, Any]:
        """One event's JSON object; an error object in its place ends the stream."""
        return self._json_object(data, endpoint, "a stream event", "choices", "mid-stream")

    def _json_object(self, raw: bytes, endpoint: EndpointState, what: str, key: str, where: str) -> dict[str, Any]:
        """``raw`` (``what`` the upstream sent) as a JSON object; an error object in place of one
        (an ``error`` without ``key``) is the upstream's failure ``where``."""
        try:
            value = json.loads(raw)
        except ValueError:
            endpoint.failed("protocol error")
            raise UpstreamFailed(f"the upstream sent {what} that is not JSON") from None
        if not isinstance(value, dict):
            endpoint.failed("protocol error")
            raise UpstreamFailed(f"the upstream sent {what} that is not a JSON object")
        if "error" in value and key not in value:
            raise error_in_stream(value, self._scrub, where)
        return value

    # -- active health

    async def _health_loop(self) -> None:
        """Check every endpoint each interval, all at once, so a slow one does not delay the others' verdicts."""
        while True:
            # A check slower than its interval is as good as a failed one.
            timeout = min(self.config.idle_seconds, max(self.config.health_interval_seconds, 1.0))
            await asyncio.gather(*(check(endpoint, self._transport, timeout, MAX_ERROR_BODY)
                                   for endpoint in self._endpoints))  # fmt: skip
            await asyncio.sleep(self.config.health_interval_seconds)
