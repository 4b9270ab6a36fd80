"""The client of one model's upstream fleet: OpenAI-compatible servers behind one name.

One ``Fleet`` per served model. It keeps one pooled keep-alive HTTP client
for all the model's endpoints and decides, per request, where it goes and
what to do when that fails:

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
  answer is one JSON object (embeddings: ``post``) takes the same placement,
  retries and failover; its answer is read whole, up to ``MAX_JSON_ANSWER``.
- **Errors** become the four kinds of ``errors.py``, with scrubbed messages.
  Only the fleet's own headers, the api key and the caller's allowed headers
  go upstream; the upstream's response headers stay here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from backends.openai.errors import (
    Scrubber,
    UpstreamError,
    UpstreamFailed,
    UpstreamUnavailable,
    error_from_answer,
    error_in_stream,
)
from backends.openai.health import EndpointState, EndpointStatus
from backends.openai.routing import LeastOutstanding, PrefixRing
from backends.openai.sse import EventReader

__all__ = ["EndpointStatus", "Fleet", "FleetConfig"]

log = logging.getLogger(__name__)

USER_AGENT = "inferflux"
BACKOFF_BASE_SECONDS = 0.05  # the first retry waits up to this (full jitter), each next one up to twice as long
BACKOFF_CAP_SECONDS = 1.0
MAX_ERROR_BODY = 64 * 1024  # what is read of a non-2xx answer to find its error message
# An idle pooled connection is dropped before the upstream drops it: uvicorn (vLLM, SGLang, InferFlux)
# closes idle keep-alive connections after 5 s, and reusing one as it closes fails a request that
# sent nothing (seen here: health checks 5 s apart hit that race and marked a live endpoint down).
KEEPALIVE_SECONDS = 4.0
DRAIN_SECONDS = 0.1  # how long the end of a body is awaited after [DONE] (then the connection is closed)
# The largest JSON answer ``post`` reads: 2048 embeddings of 4096 floats written out in full
# (about 20 characters each) take ~170 MB; more is a broken upstream, not an answer.
MAX_JSON_ANSWER = 256 * 1024 * 1024
DRAIN_READS = 4
# Headers the fleet sets itself (or that frame the HTTP exchange): a caller's copy is dropped, never sent.
RESERVED_HEADERS = frozenset({
    "authorization", "proxy-authorization", "cookie", "host", "content-type", "content-length",
    "transfer-encoding", "connection", "keep-alive", "te", "trailer", "upgrade", "expect", "accept",
    "accept-encoding", "user-agent",
})  # fmt: skip
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _endpoint_url(position: int, url: str) -> str:
    """``url`` checked and without its trailing slash; ValueError (not naming the URL: it may hold a password)."""
    where = f"endpoints[{position}]"
    if not isinstance(url, str) or not url or url != url.strip() or _BAD_VALUE.search(url) or " " in url:
        raise ValueError(f"{where}: not a URL")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError:
        raise ValueError(f"{where}: not a URL") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{where}: the scheme must be http or https")
    if "@" in parts.netloc:
        raise ValueError(f"{where}: credentials in the URL are not allowed (use the api key)")
    if not parts.hostname:
        raise ValueError(f"{where}: the URL has no host")
    if "?" in url or "#" in url:
        raise ValueError(f"{where}: a base URL takes no query or fragment")
    return url.rstrip("/")


@dataclass(frozen=True)
class FleetConfig:
    """How to reach one model's upstream fleet and how patient to be with it.

    ``api_key`` is sent as ``Authorization: Bearer``; it is left out of the
    repr and of every error and status. ``timeout_seconds`` bounds a whole
    request, stream included; the longest silence tolerated before the answer
    or between two stream chunks is ``min(timeout_seconds,
    idle_timeout_seconds)``. ``retries`` extra attempts are made, only before
    the first byte of the body. ``health_interval_seconds`` 0 turns the
    active check off (the breaker still learns from requests). ``ca_file``
    is for https endpoints behind a private CA, since the client reads no
    environment variables (see ``Fleet``).
    """

    endpoints: tuple[str, ...]
    api_key: str | None = field(default=None, repr=False)
    timeout_seconds: float = 600.0
    idle_timeout_seconds: float = 60.0
    connect_timeout_seconds: float = 5.0
    max_inflight_per_endpoint: int = 64
    retries: int = 2
    health_interval_seconds: float = 5.0
    breaker_failures: int = 5
    breaker_reset_seconds: float = 10.0
    routing: Literal["least_outstanding", "prefix"] = "prefix"
    ca_file: str | None = None  # a PEM bundle that https endpoints' certificates must chain to (default: the system's)

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            raise ValueError("endpoints: a list of base URLs, not one string")
        endpoints = tuple(_endpoint_url(i, url) for i, url in enumerate(self.endpoints))
        if not endpoints:
            raise ValueError("endpoints: at least one is needed")
        if len(set(endpoints)) != len(endpoints):
            raise ValueError("endpoints: the same URL is listed twice")
        object.__setattr__(self, "endpoints", endpoints)
        if self.api_key is not None and (not self.api_key or _BAD_VALUE.search(self.api_key) or
                                         self.api_key != self.api_key.strip()):  # fmt: skip
            raise ValueError("api_key: empty, or holds whitespace or control characters at its ends")
        for name in ("timeout_seconds", "idle_timeout_seconds", "connect_timeout_seconds", "breaker_reset_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be above 0")
        if not self.health_interval_seconds >= 0:
            raise ValueError("health_interval_seconds: must be 0 (off) or above")
        for name in ("max_inflight_per_endpoint", "breaker_failures"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name}: must be a whole number, 1 or more")
        if not (isinstance(self.retries, int) and self.retries >= 0):
            raise ValueError("retries: must be a whole number, 0 or more")
        if self.routing not in ("least_outstanding", "prefix"):
            raise ValueError("routing: must be least_outstanding or prefix")

    @property
    def idle_seconds(self) -> float:
        """The longest silence tolerated from an upstream, before its answer or between two chunks."""
        return min(self.timeout_seconds, self.idle_timeout_seconds)


class _DeadlinePassed(Exception):
    """The whole request ran past ``timeout_seconds``."""


class _Retry(Exception):
    """An attempt failed before the first body byte; ``error`` is what the client gets if it was the last."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True, slots=True)
class _Outgoing:
    """A request's parts, built once; each attempt makes its own httpx request from them."""

    path: str
    headers: dict[str, str]
    content: bytes
    media: str  # the answer's content type: text/event-stream (``stream``) or application/json (``post``)


@dataclass
class _Opened:
    """An attempt that got past the first body byte: the stream's state from there on."""

    index: int
    probe: bool
    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes


class Fleet:
    """Sends requests to one model's endpoints; see the module docstring for the policy.

    Used from one event loop (the gateway's). ``clock`` drives the circuit
    breakers only (tests pass a fake one); timeouts run on real time. The
    client reads nothing from the environment (no proxy variables, no
    ``.netrc``): where requests go and what credential they carry is the
    configuration's alone. ``transport`` replaces the network (tests only).
    """

    def __init__(self, config: FleetConfig, *, transport: httpx.AsyncBaseTransport | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:  # fmt: skip
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
        headers = {"user-agent": USER_AGENT, "accept-encoding": "identity"}  # compression would hold chunks back
        if config.api_key:
            headers["authorization"] = f"Bearer {config.api_key}"
        # Every endpoint's cap, plus one connection each for the health check.
        slots = len(self._endpoints) * (config.max_inflight_per_endpoint + 1)
        self._client = httpx.AsyncClient(
            transport=transport,
            limits=httpx.Limits(max_connections=slots, max_keepalive_connections=slots,
                                keepalive_expiry=KEEPALIVE_SECONDS),  # fmt: skip
            timeout=httpx.Timeout(config.idle_seconds, connect=config.connect_timeout_seconds,
                                  pool=config.connect_timeout_seconds),  # fmt: skip
            headers=headers,
            verify=_tls(config.ca_file),
            follow_redirects=False,  # a redirect could lead the api key elsewhere
            trust_env=False,  # no proxy variables, no .netrc credentials: only what the config says
            # One client serves every tenant: a cookie an upstream (or its load balancer) sets must not
            # ride along on other tenants' requests, so none is ever kept.
            cookies=CookieJar(policy=_NoCookies()),
        )
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
        await self._client.aclose()

    def set_api_key(self, api_key: str | None) -> None:
        """A rotated key, sent from the next request on; every key this fleet has held stays scrubbed."""
        if api_key:
            self._keys_held.add(api_key)
            self._client.headers["authorization"] = f"Bearer {api_key}"
        else:
            self._client.headers.pop("authorization", None)
        self._scrub = Scrubber(self._keys_held, self.config.endpoints)

    def statuses(self) -> list[EndpointStatus]:
        """Each endpoint's state and counters, in configuration order."""
        return [endpoint.status() for endpoint in self._endpoints]

    # -- requests

    async def stream(self, path: str, body: Mapping[str, Any], *, affinity: bytes | None = None,
                     headers: Mapping[str, str] | None = None) -> AsyncGenerator[dict[str, Any], None]:  # fmt: skip
        """POST ``body`` (the caller sets ``"stream": true``) to base + ``path``; yield each event's JSON object.

        Ends at ``data: [DONE]`` or at the end of the body. Raises
        ``UpstreamUnavailable`` before anything is sent when no endpoint can
        take the request, ``UpstreamRejected`` for a 4xx, ``UpstreamFailed``
        otherwise. Closing the generator early (``aclose``, cancelling the
        task that reads it) closes the upstream connection at once.
        ``headers`` are sent as given (the caller's allow-list), except the
        ones the fleet sets itself.
        """
        if self._closed:
            raise UpstreamUnavailable("the upstream fleet is closed", retry_after=1.0)
        request = self._request(path, body, headers, "text/event-stream")
        deadline = time.monotonic() + self.config.timeout_seconds
        opened = await self._open(request, affinity, deadline)
        reader = EventReader()
        async with self._reading(opened, "stream cut", "mid-stream") as endpoint:
            raw: bytes | None = opened.first
            while raw is not None:
                for data in reader.feed(raw):
                    if data == b"[DONE]":
                        await self._read_to_end(opened.chunks)
                        return
                    yield self._event(data, endpoint)
                raw = await self._next_bytes(opened.chunks, deadline)
            for data in reader.close():
                if data == b"[DONE]":
                    return
                yield self._event(data, endpoint)

    async def post(self, path: str, body: Mapping[str, Any], *, affinity: bytes | None = None,
                   headers: Mapping[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
        """POST ``body`` to base + ``path`` and return the JSON object it answers (embeddings).

        Placement, retries before the first byte, errors and headers as for
        ``stream``; the answer is read whole (up to ``MAX_JSON_ANSWER`` bytes),
        within ``timeout_seconds``, and must be a JSON object.
        """
        if self._closed:
            raise UpstreamUnavailable("the upstream fleet is closed", retry_after=1.0)
        request = self._request(path, body, headers, "application/json")
        deadline = time.monotonic() + self.config.timeout_seconds
        opened = await self._open(request, affinity, deadline)
        parts, size = [opened.first], len(opened.first)
        async with self._reading(opened, "answer cut", "mid-answer") as endpoint:
            while (raw := await self._next_bytes(opened.chunks, deadline)) is not None:
                size += len(raw)
                if size > MAX_JSON_ANSWER:
                    endpoint.failed("answer too large")
                    raise UpstreamFailed(f"the upstream's answer is larger than {MAX_JSON_ANSWER // 2**20} MiB")
                parts.append(raw)
        return self._json_object(b"".join(parts), endpoint, "an answer", "data", "in its answer")

    @contextlib.asynccontextmanager
    async def _reading(self, opened: _Opened, cut: str, where: str) -> AsyncIterator[EndpointState]:
        """While an opened answer's body is read: its failures as the caller's errors (``cut``: the
        endpoint's last error for a lost connection; ``where``: the message's), the endpoint released after."""
        endpoint = self._endpoints[opened.index]
        try:
            yield endpoint
        except httpx.TimeoutException:
            endpoint.failed("stalled")
            raise UpstreamFailed(f"the upstream sent nothing for {self.config.idle_seconds:g} s") from None
        except httpx.TransportError:
            endpoint.failed(cut)
            raise UpstreamFailed(f"the upstream connection was lost {where}") from None
        except _DeadlinePassed:
            raise UpstreamFailed(f"the upstream did not finish within {self.config.timeout_seconds:g} s") from None
        finally:
            endpoint.release(opened.probe)
            await opened.response.aclose()


    @staticmethod
    def _request(path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None, media: str) -> _Outgoing:
        """What every attempt sends, whichever endpoint it goes to; ``media``: the answer's content type."""
        if not path.startswith("/") or "?" in path or "#" in path:
            raise ValueError("path: an absolute path under the base URL, like /chat/completions")
        sent = {"content-type": "application/json", "accept": media}
        for name, value in (headers or {}).items():
            lowered = name.lower()
            # A header httpx would refuse to send would look like the endpoint's failure: drop it here.
            if lowered not in RESERVED_HEADERS and _TOKEN.fullmatch(name) and not _BAD_VALUE.search(value):
                sent[lowered] = value
        content = json.dumps(dict(body), separators=(",", ":"), ensure_ascii=False).encode()
        return _Outgoing(path, sent, content, media)

    async def _open(self, request: _Outgoing, affinity: bytes | None, deadline: float) -> _Opened:
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
            raise UpstreamUnavailable("no upstream endpoint can take the request now", retry_after=self._retry_after())
        if isinstance(last, UpstreamUnavailable):  # the endpoints' state may have moved since
            last.retry_after = max(last.retry_after, self._retry_after())
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

    async def _attempt(self, index: int, request: _Outgoing, deadline: float) -> _Opened:
        """One try on one endpoint; raises ``_Retry`` for what another try may fix, the final error otherwise."""
        endpoint = self._endpoints[index]
        probe = endpoint.acquire()
        response: httpx.Response | None = None
        try:
            attempt = self._client.build_request("POST", endpoint.url + request.path, headers=request.headers,
                                                 content=request.content)  # fmt: skip
            try:
                response = await self._within(deadline, self._client.send(attempt, stream=True))
                status = response.status_code
                if status < 200 or status >= 300:
                    raise self._refusal(endpoint, status, await self._start_of(response, deadline), response)
                media = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
                if media != request.media:
                    streamed = request.media == "text/event-stream"
                    endpoint.failed("not a stream" if streamed else "not JSON")
                    raise UpstreamFailed("the upstream answered without streaming" if streamed
                                         else "the upstream's answer is not JSON")  # fmt: skip
                endpoint.succeeded()
                chunks = response.aiter_bytes()
                first = await self._next_bytes(chunks, deadline)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout):
                endpoint.failed("connect error")
                raise _Retry(UpstreamUnavailable("no upstream endpoint could be reached", retry_after=1.0)) from None
            except httpx.TimeoutException:
                endpoint.failed("timed out")
                raise _Retry(UpstreamFailed(f"the upstream did not answer within {self.config.idle_seconds:g} s"))
            except httpx.TransportError:
                endpoint.failed("connection error")
                raise _Retry(UpstreamFailed("the upstream connection failed before its answer")) from None
            except _DeadlinePassed:
                raise UpstreamFailed(f"the upstream did not answer within {self.config.timeout_seconds:g} s") from None
            if first is None:
                endpoint.failed("empty stream")
                raise _Retry(UpstreamFailed("the upstream closed the stream without sending anything"))
            return _Opened(index, probe, response, chunks, first)
        except BaseException:
            endpoint.release(probe)
            if response is not None:
                await response.aclose()
            raise

    def _refusal(self, endpoint: EndpointState, status: int, start: bytes, response: httpx.Response) -> Exception:
        """What a non-2xx answer means: ``_Retry`` for a busy or failing endpoint, the error itself for a 4xx."""
        if status == 429:  # busy, not broken: try another, and say when to come back if all are
            retry_after = _seconds(response.headers.get("retry-after"))
            return _Retry(UpstreamUnavailable("the upstream is busy", retry_after=retry_after))
        if 400 <= status < 500 and status != 408:
            endpoint.succeeded()  # it answered: the request (or our credential), not the endpoint, is at fault
            return error_from_answer(status, start, self._scrub)
        # 5xx, a timeout of its own, or a redirect (never followed: it could lead the api key elsewhere).
        endpoint.failed(f"HTTP {status}")
        return _Retry(UpstreamFailed(f"the upstream failed (HTTP {status})"))

    async def _start_of(self, response: httpx.Response, deadline: float) -> bytes:
        """Up to ``MAX_ERROR_BODY`` bytes of an error answer; what came before a failure to read the rest."""
        parts: list[bytes] = []
        size = 0
        chunks = response.aiter_bytes()
        try:
            while size < MAX_ERROR_BODY:
                raw = await self._next_bytes(chunks, deadline)
                if raw is None:
                    break
                parts.append(raw)
                size += len(raw)
        except (httpx.TransportError, _DeadlinePassed):
            pass
        return b"".join(parts)[:MAX_ERROR_BODY]

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

    @staticmethod
    async def _read_to_end(chunks: AsyncIterator[bytes]) -> None:
        """Read what follows ``[DONE]`` (the chunked body's last chunk) so the connection returns to the pool.

        A server on uvicorn (the fake upstream; any Starlette or FastAPI one)
        writes ``[DONE]`` and the end of the body separately; a response closed
        between the two loses its connection, and the next request pays a new
        TCP connection to the upstream. An upstream that sends more than a few
        pieces, or nothing, within ``DRAIN_SECONDS`` is not waited for: its
        connection is closed.
        """
        try:
            async with asyncio.timeout(DRAIN_SECONDS):
                for _ in range(DRAIN_READS):
                    if await anext(chunks, None) is None:
                        return
        except (TimeoutError, httpx.HTTPError):
            pass

    async def _next_bytes(self, chunks: AsyncIterator[bytes], deadline: float) -> bytes | None:
        """The next piece of the body (None at its end), within the request's deadline.

        httpx's read timeout (the idle timeout) bounds each read; only when the
        deadline is nearer than that does a timer of our own go around it.
        """
        remaining = deadline - time.monotonic()
        if remaining >= self.config.idle_seconds:
            return await anext(chunks, None)
        return await self._within(deadline, anext(chunks, None))

    @staticmethod
    async def _within(deadline: float, awaitable: Any) -> Any:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            async with asyncio.timeout(remaining):
                return await awaitable
        except TimeoutError:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()  # never awaited when the deadline had already passed
            raise _DeadlinePassed from None

    def _retry_after(self) -> float:
        """Seconds until retrying is worth it: 1 when an endpoint is only full, else the soonest half-open."""
        waits = []
        for endpoint in self._endpoints:
            opens_in = endpoint.half_opens_in()
            if opens_in is not None:
                waits.append(opens_in)
            elif endpoint.healthy:
                return 1.0  # full (or its probe is out): slots free up as requests finish
        return max(0.1, min(waits)) if waits else 1.0

    # -- active health

    async def _health_loop(self) -> None:
        """Check every endpoint each interval, all at once, so a slow one does not delay the others' verdicts."""
        while True:
            await asyncio.gather(*(self._check(endpoint) for endpoint in self._endpoints))
            await asyncio.sleep(self.config.health_interval_seconds)

    async def _check(self, endpoint: EndpointState) -> None:
        """``GET {base}/models``: an answer below 500 means the server is up (a 401 is about the key)."""
        # A check slower than its interval is as good as a failed one.
        timeout = min(self.config.idle_seconds, max(self.config.health_interval_seconds, 1.0))
        for _attempt in range(2):
            try:
                async with asyncio.timeout(timeout):
                    async with self._client.stream("GET", endpoint.url + "/models") as response:
                        await self._start_of(response, time.monotonic() + timeout)
                        healthy, why = response.status_code < 500, f"HTTP {response.status_code}"
            except httpx.RemoteProtocolError as exc:
                # A pooled connection the server closed just then: not a dead server, ask once more.
                healthy, why = False, type(exc).__name__
                continue
            except (httpx.HTTPError, TimeoutError, OSError) as exc:
                healthy, why = False, type(exc).__name__
            except Exception as exc:  # anything else must not end the loop that checks every endpoint
                log.exception("upstream endpoint %s: the health check failed unexpectedly", endpoint.url)
                healthy, why = False, type(exc).__name__
            break
        if healthy != endpoint.healthy:
            state = "healthy again" if healthy else "unhealthy"
            log.warning("upstream endpoint %s is %s (%s)", endpoint.url, state, why)
        endpoint.healthy = healthy


def _tls(ca_file: str | None) -> ssl.SSLContext | bool:
    """httpx's ``verify``: the system's CAs, or only ``ca_file``'s; ValueError when that cannot be read."""
    if not ca_file:
        return True
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError):
        raise ValueError("ca_file: cannot be read as a PEM bundle of CA certificates") from None


class _NoCookies(DefaultCookiePolicy):
    """Keeps no cookie and sends none."""

    def set_ok(self, cookie: Any, request: Any) -> bool:
        return False

    def return_ok(self, cookie: Any, request: Any) -> bool:
        return False


def _seconds(value: str | None) -> float:
    """A Retry-After in seconds, kept within 1-60 s; 1 when absent or an HTTP date (not worth parsing)."""
    try:
        seconds = float(value) if value is not None else 1.0
    except ValueError:
        return 1.0
    return min(60.0, max(1.0, seconds)) if seconds == seconds else 1.0
