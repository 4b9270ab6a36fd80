"""The fleet's HTTP client: one pooled aiohttp session for all of a model's endpoints.

aiohttp rather than httpx because the fleet is on every remote request's path
and the client was its largest cost: streaming a 16-token answer cost 1.5 ms
of CPU through httpx (its pure-Python h11 parser and anyio layers) and 0.58 ms
through aiohttp (a C parser), measured alone in one process
(docs/benchmarks.md, "In front of an upstream, against LiteLLM").

What the session guarantees, whatever the configuration:

- **Pooled keep-alive**, an idle connection dropped after ``KEEPALIVE_SECONDS``,
  before uvicorn-based servers (vLLM, SGLang, InferFlux) drop theirs at 5 s:
  reusing a connection just as the server closes it fails a request that sent
  nothing.
- **Nothing from the environment**: no proxy variables, no ``.netrc``
  (``trust_env`` off); TLS verifies against the system's CAs or only
  ``ca_file``'s. Redirects are never followed (one could lead the api key
  elsewhere), and no cookie is kept: one session serves every tenant, so an
  upstream's (or its load balancer's) Set-Cookie must not ride along on other
  tenants' requests.
- **Only where the egress rules allow** (``egress.py``): every address a host
  name resolves to is checked before a connection is made to it.
- **Timeouts per phase**: ``connect`` (a new connection, or a free one from a
  full pool), ``idle`` (silence before the answer or between two reads; off
  for a *patient* request, a generation asked for unstreamed, which is silent
  until it is done) and the request's deadline (``Answer.read`` and
  ``within``), which the fleet owns.

aiohttp's exceptions become the three kinds below, so the fleet decides about
retries without knowing the library. The session is bound to an event loop,
so it is made on first use, in the loop that uses it (a model is opened off
the loop).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from inferflux.backends.openai.config import BAD_VALUE
from inferflux.backends.openai.egress import EgressPolicy, EgressRefused

__all__ = ["Answer", "CheckedResolver", "ConnectFailed", "ConnectionLost", "DeadlinePassed", "Outgoing", "TimedOut", "Transport"]

T = TypeVar("T")
log = logging.getLogger("inferflux.backends.openai.transport")

USER_AGENT = "inferflux"
KEEPALIVE_SECONDS = 4.0
# Headers the fleet sets itself (or that frame the HTTP exchange): a caller's copy is dropped, never sent.
RESERVED_HEADERS = frozenset({
    "authorization", "proxy-authorization", "cookie", "host", "content-type", "content-length",
    "transfer-encoding", "connection", "keep-alive", "te", "trailer", "upgrade", "expect", "accept",
    "accept-encoding", "user-agent",
})  # fmt: skip
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


class ConnectFailed(Exception):
    """No connection: refused, unresolvable, TLS refused, or none within the connect timeout. Nothing was sent."""


class TimedOut(Exception):
    """The upstream sent nothing for the idle timeout."""


class ConnectionLost(Exception):
    """The connection broke after it was made (reset, closed early, a malformed answer)."""


class DeadlinePassed(Exception):
    """The whole request ran past its deadline."""


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A request's parts, built once; every attempt sends them to its own endpoint."""

    path: str
    headers: dict[str, str]
    content: bytes
    media: str  # the answer's content type: text/event-stream or application/json
    patient: bool = False  # the upstream works before it answers: no idle timeout on the wait

    @classmethod
    def of(cls, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None, media: str,
           patient: bool = False) -> Outgoing:  # fmt: skip
        """``body`` as JSON to base + ``path``, with the caller's headers less those the fleet sets itself."""
        if not path.startswith("/") or "?" in path or "#" in path:
            raise ValueError("path: an absolute path under the base URL, like /chat/completions")
        sent = {"content-type": "application/json", "accept": media}
        for name, value in (headers or {}).items():
            lowered = name.lower()
            # A header the client would refuse to send would look like the endpoint's failure: drop it here.
            if lowered not in RESERVED_HEADERS and _TOKEN.fullmatch(name) and not BAD_VALUE.search(value):
                sent[lowered] = value
        content = json.dumps(dict(body), separators=(",", ":"), ensure_ascii=False).encode()
        return cls(path, sent, content, media, patient)


async def within(deadline: float, awaitable: Awaitable[T]) -> T:
    """``awaitable``'s result, or DeadlinePassed once ``deadline`` (``time.monotonic``) is reached."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        close = getattr(awaitable, "close", None)  # a coroutine, or aiohttp's request (one wraps a coroutine)
        if close is not None:
            close()  # never awaited: the deadline had already passed
        raise DeadlinePassed
    timer = asyncio.timeout(remaining)
    try:
        async with timer:
            return await awaitable
    except TimeoutError:
        if timer.expired():
            raise DeadlinePassed from None
        raise  # the client's own timeout, not the deadline


class Answer:
    """An upstream's answer once its headers are in: the status, two headers, and the body as it arrives."""

    __slots__ = ("status", "media", "retry_after", "_response", "_idle")

    def __init__(self, response: aiohttp.ClientResponse, idle: float | None) -> None:
        self._response = response
        self._idle = idle
        self.status = response.status
        headers = response.headers
        self.media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        self.retry_after = headers.get("retry-after")

    async def read(self, deadline: float) -> bytes | None:
        """What arrived since the last read (all of it, however many events: one network read), None at the end.

        The idle timeout bounds each read; only when the deadline is nearer than
        that does a timer of our own go around it (one timer a read costs more
        than the read).
        """
        content = self._response.content
        try:
            if self._idle is not None and deadline - time.monotonic() >= self._idle:
                data = await content.readany()
            else:
                data = await within(deadline, content.readany())
        except aiohttp.ServerTimeoutError:
            raise TimedOut from None
        except (aiohttp.ClientError, OSError):
            raise ConnectionLost from None
        return data or None

    async def start(self, limit: int, deadline: float) -> bytes:
        """Up to ``limit`` bytes of the body (an error answer's start); what came before a failure to read on."""
        parts: list[bytes] = []
        size = 0
        try:
            while size < limit and (data := await self.read(deadline)) is not None:
                parts.append(data)
                size += len(data)
        except (TimedOut, ConnectionLost, DeadlinePassed):
            pass
        return b"".join(parts)[:limit]

    async def drain(self, seconds: float, reads: int) -> None:
        """Read to the body's end, so that the connection goes back to the pool; give up after ``seconds``
        or ``reads`` pieces (then ``close`` drops it)."""
        try:
            async with asyncio.timeout(seconds):
                for _ in range(reads):
                    if await self._response.content.readany() == b"":
                        return
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass

    def close(self) -> None:
        """Done with it: a body read to its end has already given its connection back to the pool; one
        still open loses its connection, which is how an upstream learns that nobody reads any more."""
        self._response.close()


class CheckedResolver(AbstractResolver):
    """aiohttp's resolver with ``EgressPolicy.check_address`` over every address a name resolves to.

    ``inner`` does the lookup (default: aiohttp's, getaddrinfo on a thread). A
    name with any refused address is refused as a whole, as a failed lookup
    (aiohttp's ClientConnectorDNSError: ConnectFailed, nothing sent). aiohttp
    connects to an IP literal without asking a resolver: those were checked
    whole by ``EgressPolicy.check_endpoint`` when the fleet was configured.
    """

    def __init__(self, policy: EgressPolicy, inner: AbstractResolver | None = None) -> None:
        self._policy = policy
        self._inner = inner if inner is not None else DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:  # fmt: skip
        results = await self._inner.resolve(host, port, family)
        try:
            for result in results:
                self._policy.check_address(host, port, ipaddress.ip_address(result["host"]))
        except EgressRefused as exc:
            log.warning("an upstream connection was refused by the egress rules: %s", exc)
            raise
        return results

    async def close(self) -> None:
        await self._inner.close()


class Transport:
    """The session every request of one fleet goes through; used from one event loop at a time."""

    def __init__(self, *, slots: int, connect_seconds: float, idle_seconds: float, ca_file: str | None,
                 api_key: str | None, egress: EgressPolicy, resolver: AbstractResolver | None = None) -> None:  # fmt: skip
        """``resolver`` looks host names up (default: aiohttp's); ``egress`` judges what it finds."""
        self._tls = tls_context(ca_file)
        self._egress = egress
        self._resolver = resolver
        self._slots = slots
        self._idle = idle_seconds
        connect = {"connect": connect_seconds, "sock_connect": connect_seconds}
        self._timeout = aiohttp.ClientTimeout(total=None, sock_read=idle_seconds, **connect)
        self._patient_timeout = aiohttp.ClientTimeout(total=None, sock_read=None, **connect)
        self._headers: dict[str, str] = {}
        self.set_api_key(api_key)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def set_api_key(self, api_key: str | None) -> None:
        """The key sent from the next request on (None: none)."""
        # Compression would hold chunks back until a block is full.
        headers = {"user-agent": USER_AGENT, "accept-encoding": "identity"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._headers = headers

    def _current(self) -> aiohttp.ClientSession:
        if self._closed:  # a retry or a health check racing the close must not open a session nobody closes
            raise ConnectFailed
        loop = asyncio.get_running_loop()
        session = self._session
        if session is None or session.closed or self._loop is not loop:
            # A session serves the loop it was made in; another loop (tests; a restarted server) gets its own.
            connector = aiohttp.TCPConnector(limit=self._slots, limit_per_host=0, keepalive_timeout=KEEPALIVE_SECONDS,
                                             ssl=self._tls, resolver=CheckedResolver(self._egress, self._resolver))  # fmt: skip
            session = self._session = aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False, timeout=self._timeout,
            )  # fmt: skip
            self._loop = loop
        return session

    async def send(self, url: str, request: Outgoing, deadline: float) -> Answer:
        """POST ``request`` to ``url`` and wait for the answer's headers, within the deadline."""
        timeout = self._patient_timeout if request.patient else self._timeout
        response = await self._exchange("POST", url, deadline, {**self._headers, **request.headers},
                                        data=request.content, timeout=timeout)  # fmt: skip
        return Answer(response, None if request.patient else self._idle)

    async def get_status(self, url: str, timeout: float, limit: int) -> int:
        """``GET url``'s status, its body's start read and dropped, within ``timeout``; raises the kinds above
        (and TimeoutError)."""
        deadline = time.monotonic() + timeout
        try:
            answer = Answer(await self._exchange("GET", url, deadline, self._headers), self._idle)
        except DeadlinePassed:
            raise TimeoutError from None
        try:
            await answer.start(limit, deadline)
        finally:
            answer.close()
        return answer.status

    async def _exchange(self, method: str, url: str, deadline: float, headers: dict[str, str],
                        **options: Any) -> aiohttp.ClientResponse:  # fmt: skip
        """The response to one request once its headers are in; aiohttp's failures as the three kinds."""
        sending = self._current().request(method, url, headers=headers, allow_redirects=False, **options)
        try:
            return await within(deadline, sending)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
            raise ConnectFailed from None
        except aiohttp.ServerTimeoutError:
            raise TimedOut from None
        except (aiohttp.ClientError, OSError):
            raise ConnectionLost from None

    async def aclose(self) -> None:
        """Close every pooled connection; later requests fail as ConnectFailed."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()


def tls_context(ca_file: str | None) -> ssl.SSLContext | bool:
    """aiohttp's ``ssl``: True (the system's CAs, verified), or a context of only ``ca_file``'s; ValueError
    when that cannot be read."""
    if not ca_file:
        return True
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError):
        raise ValueError("ca_file: cannot be read as a PEM bundle of CA certificates") from None
