"""Client-disconnect handling and the Server-Sent Events response.

Generation is expensive, so a request whose client has gone must stop at once.
Starlette's StreamingResponse only notices a disconnect on ASGI servers older
than spec 2.4 (newer ones are expected to raise on ``send``, which happens
only when the next token arrives, and never while a request waits in the
engine's queue). Both helpers here watch ``receive`` for ``http.disconnect``
explicitly and cancel the work as soon as it arrives.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

log = logging.getLogger("inferflux.gateway.streaming")

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it and raise ClientDisconnected if the client leaves first.

    Call only after the request body has been read, since this consumes
    ``receive``.
    """
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


def sse_event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse_event("[DONE]")


class SSEResponse:
    """Streams pre-encoded SSE events; ``on_close`` always runs, even if the
    body never started (a generator's own ``finally`` would not)."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.body = body
        self.on_close = on_close
        self.headers = {
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-cache",
            # Reverse proxies must pass each token through as it comes.
            "x-accel-buffering": "no",
            **(headers or {}),
        }

    async def _pump(self, send: Send) -> None:
        async for chunk in self.body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        # The stream is complete: close it (usage settled) before the last
        # message, which the audit layer holds until the call is on record.
        await self._close()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _close(self) -> None:
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            await on_close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()],
            }
        )
        try:
            await run_until_disconnect(receive, self._pump(send))
        except (ClientDisconnected, OSError):
            # OSError: a spec-2.4 server reports the disconnect on send.
            log.debug("client disconnected mid-stream")
        finally:
            aclose = getattr(self.body, "aclose", None)
            if aclose is not None:
                await aclose()
            await self._close()
