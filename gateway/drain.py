"""A clean stop: readiness fails first, new work is refused, work in flight gets a grace period.

On SIGTERM ``inferctl serve`` calls ``Drain.begin``: from then on ``/readyz``
answers 503 (an orchestrator stops sending traffic) and ``ServiceGate``
answers every new request but the probes with 503 ``server_shutting_down``.
Requests in flight run on until they end or ``server.shutdown_grace_seconds``
passes; then ``deadline`` is set, and every stream still running ends with an
SSE error event and ``[DONE]`` (its sequences aborted, its usage settled, its
audit event saying it was interrupted), and a JSON request still waiting gets
503. Only then is uvicorn told to exit, so it has nothing left to cut off.
A second signal exits at once (uvicorn's force exit).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from inferflux.policy.errors import ApiError

log = logging.getLogger("inferflux.gateway.drain")

INTERRUPTED_REASON = "interrupted: the server shut down"
# After the grace: how long uvicorn may take to flush the last bytes and close connections.
CLOSE_SECONDS = 3


class ShuttingDown(ApiError):
    """503: the server is stopping; retry on another replica."""

    status_code = 503
    error_type = "server_error"
    default_code = "server_shutting_down"

    def __init__(self, message: str = "The server is shutting down; retry on another replica") -> None:
        super().__init__(message, headers={"retry-after": "1", "connection": "close"})


class Drain:
    """The app's stop state: ``draining`` (refuse new work), ``deadline`` (end what still runs), in-flight count."""

    def __init__(self) -> None:
        self.draining = False
        self.deadline = asyncio.Event()
        self.inflight = 0
        self._task: asyncio.Task[None] | None = None

    def begin(self, grace: float, then: Any = None) -> None:
        """Start draining (on the event loop); ``then()`` runs once nothing is in flight or the grace is over."""
        if self.draining:
            return
        self.draining = True
        log.warning("shutting down: refusing new requests; %d in flight get up to %.0f s", self.inflight, grace)
        self._task = asyncio.get_running_loop().create_task(self._finish(grace, then), name="drain")

    async def _finish(self, grace: float, then: Any) -> None:
        ends = time.monotonic() + grace
        while self.inflight and time.monotonic() < ends:
            await asyncio.sleep(0.05)
        if self.inflight:
            log.warning("shutdown grace over: ending %d request(s) still in flight", self.inflight)
        self.deadline.set()
        # Let the interrupted requests send their last message before the server stops.
        ends = time.monotonic() + CLOSE_SECONDS
        while self.inflight and time.monotonic() < ends:
            await asyncio.sleep(0.05)
        if then is not None:
            then()


def drain_of(app: Any) -> Drain | None:
    return getattr(app.state, "drain", None) if app is not None else None


def serve(app: Any, *, host: str, port: int, log_level: str, grace: float, **config: Any) -> None:
    """``uvicorn.run`` whose first SIGTERM/SIGINT drains (``Drain``) instead of closing the listener at once."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            drain = drain_of(app)
            if drain is None or drain.draining or self.should_exit:
                super().handle_exit(sig, frame)  # a second signal: uvicorn's force exit
                return
            # Kept, as uvicorn does, to re-raise once the server has stopped (the exit status says SIGTERM).
            self._captured_signals.append(sig)
            asyncio.get_event_loop().call_soon_threadsafe(drain.begin, grace, self._exit_now)

        def _exit_now(self) -> None:
            self.should_exit = True

    # The drain ends the requests; uvicorn then only waits for their last bytes.
    config = {"timeout_graceful_shutdown": CLOSE_SECONDS, **config}
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, **config))
    server.run()
