"""Client-disconnect handling and the Server-Sent Events response.

Generation is expensive, so a request whose client has gone must stop at once.
Starlette's StreamingResponse only notices a disconnect on ASGI servers older
than spec 2.4 (newer ones are expected to raise on ``send``, which happens
only when the next token arrives, and never while a request waits in the
engine's queue). Both helpers here watch ``receive`` for ``http.disconnect``
explicitly and cancel the work as soon as it arrives.

They also end the work when a draining server's grace is over (``stop``, the
``gateway.drain`` deadline): a stream then ends with an error event and
``[DONE]`` rather than a cut connection, a JSON request with 503.

A stream's ``[DONE]`` goes out in its last message, which the audit layer holds
until the call's event is written: a client that got ``[DONE]`` without an
error before it got an answer that is on record.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

from inferflux.gateway.context import get_context
from inferflux.gateway.drain import INTERRUPTED_REASON, ShuttingDown, drain_of
from inferflux.gateway.errors import error_body
from inferflux.policy.errors import ApiError

log = logging.getLogger("inferflux.gateway.pipeline.sse")

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Awaitable[T], stop: asyncio.Event | None = None) -> T:
    """Await ``work``; cancel it and raise ClientDisconnected if the client leaves first,
    or ShuttingDown (503) if ``stop`` is set first (a drain's grace is over).

    Call only after the request body has been read, since this consumes
    ``receive``.
    """
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
    waiting = {task, watcher} if stopper is None else {task, watcher, stopper}
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        if watcher.done():
            raise ClientDisconnected()
        raise ShuttingDown("The server shut down before the answer was complete; retry on another replica")
    finally:
        for pending in waiting:
            if not pending.done():
                pending.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)


def drain_deadline(scope: Scope) -> asyncio.Event | None:
    """The event set when a draining server's grace is over (None for an app without a drain)."""
    drain = drain_of(scope.get("app"))
    return drain.deadline if drain is not None else None


# Made once: json.dumps with options builds a new encoder per call, and this runs once per streamed chunk.
_SSE_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def sse_data(payload: dict[str, Any]) -> str:
    """An SSE event's JSON data: compact, not ASCII-escaped (every stream's events, ours and the adapters')."""
    return _SSE_JSON.encode(payload)


def sse_event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else sse_data(payload)
    return f"data: {data}\n\n".encode()


SSE_DONE = sse_event("[DONE]")


class SSELast(bytes):
    """A stream's last event, held like ``[DONE]`` until the call is on record: the Responses and
    Messages APIs (``gateway.pipeline.adapters``) end their streams with an event of their own, not ``[DONE]``."""


def sse_error_end(exc: ApiError) -> bytes:
    """How a stream whose headers are gone ends in error: the error as an event, then [DONE] (as OpenAI does)."""
    return sse_event(error_body(exc)) + SSE_DONE


class SSEResponse:
    """Streams pre-encoded SSE events; ``on_close`` always runs, even if the
    body never started (a generator's own ``finally`` would not)."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]] | None = None,
        headers: dict[str, str] | None = None,
        error_end: Callable[[ApiError], bytes] = sse_error_end,
    ) -> None:
        self.body = body
        self.on_close = on_close
        self.error_end = error_end  # how this API's stream ends in error (a drain's grace over)
        self.headers = {
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-cache",
            # Reverse proxies must pass each token through as it comes.
            "x-accel-buffering": "no",
            **(headers or {}),
        }

    async def _pump(self, send: Send) -> None:
        end = b""
        async for chunk in self.body:
            if chunk == SSE_DONE or isinstance(chunk, SSELast):  # held: the end goes out once the call is on record
                end = chunk
                continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        # The stream is complete: close it (usage settled) before the last
        # message, which the audit layer holds until the call is on record.
        await self._close()
        await send({"type": "http.response.body", "body": end, "more_body": False})

    async def _end_early(self) -> None:
        aclose = getattr(self.body, "aclose", None)
        if aclose is not None:
            await aclose()
        await self._close()

    async def _close(self) -> None:
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            await on_close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        get_context(scope).stream_error_end = self.error_end  # the audit layer ends it this way too
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()],
            }
        )
        try:
            await run_until_disconnect(receive, self._pump(send), drain_deadline(scope))
        except (ClientDisconnected, OSError):
            # OSError: a spec-2.4 server reports the disconnect on send.
            log.debug("client disconnected mid-stream")
        except ShuttingDown as exc:
            # The drain's grace is over: abort and settle first, then end the stream
            # in error (the audit layer records the call, interrupted, before it goes out).
            get_context(scope).reasons.append(INTERRUPTED_REASON)
            await self._end_early()
            await send({"type": "http.response.body", "body": self.error_end(exc), "more_body": False})
        finally:
            aclose = getattr(self.body, "aclose", None)
            if aclose is not None:
                await aclose()
            await self._close()
