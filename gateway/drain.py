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

uvicorn's own shutdown would still cut off two kinds of connection: those the
kernel had accepted that the event loop had not yet taken from the listener's
queue (closing the listener resets them), and those taken whose request had
not been read yet (closed as idle). So at the exit new handshakes are refused
first (on Linux, a socket filter drops new SYNs: their clients retry and find
the port closed, a refused connect), the queue is taken in and the listener
closed, and a connection still waiting for its request keeps
``REQUEST_SECONDS`` to send it: each is answered, 503 with Retry-After like any
request during the drain. An idle kept-alive connection is closed, as always.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import struct
import time
from typing import Any

from inferflux.policy.errors import ApiError

log = logging.getLogger("inferflux.gateway.drain")

INTERRUPTED_REASON = "interrupted: the server shut down"
# After the grace: how long uvicorn may take to flush the last bytes and close connections.
CLOSE_SECONDS = 3
# At the exit: how long a connection accepted but with its request not in yet has to send it.
REQUEST_SECONDS = 1.0
# At the exit, once new handshakes are refused: how long those under way get to complete.
HANDSHAKE_SECONDS = 0.05


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
        self.begun = asyncio.Event()  # set with ``draining`` by ``begin``: what a WebSocket connection waits on
        self.inflight = 0
        self._task: asyncio.Task[None] | None = None

    def begin(self, grace: float, then: Any = None) -> None:
        """Start draining (on the event loop); ``then()`` runs once nothing is in flight or the grace is over."""
        if self.draining:
            return
        self.draining = True
        self.begun.set()
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


def answering_protocol(base: type) -> type:
    """``base`` (uvicorn's HTTP protocol), which at shutdown keeps a connection that has no
    answer yet, or has bytes of a next request, open ``REQUEST_SECONDS`` for that request:
    the draining app answers it 503, ``connection: close``. An idle kept-alive one closes at once."""

    class AnsweringAtShutdown(base):  # type: ignore[misc, valid-type]
        _awaiting = True  # accepted, or bytes came after the last answer: a request may be on its way
        _close_timer: asyncio.TimerHandle | None = None

        def data_received(self, data: bytes) -> None:
            self._awaiting = True
            super().data_received(data)

        def on_response_complete(self) -> None:
            self._awaiting = False
            super().on_response_complete()

        def shutdown(self) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and self._awaiting and not self.transport.is_closing():
                self._close_timer = self.loop.call_later(REQUEST_SECONDS, super().shutdown)
                return
            super().shutdown()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._close_timer is not None:
                self._close_timer.cancel()
            super().connection_lost(exc)

    return AnsweringAtShutdown


# A classic BPF socket filter for a TCP listener (offsets from the TCP header): drop a segment whose
# flags have SYN without ACK (a new handshake), pass everything else (the last ACK of one under way).
_NO_NEW_HANDSHAKES = [
    (0x30, 0, 0, 13),  # ldb [13]: the flags byte
    (0x54, 0, 0, 0x12),  # and #(SYN|ACK)
    (0x15, 0, 1, 0x02),  # jeq #SYN: drop, else pass
    (0x06, 0, 0, 0),  # ret #0: drop
    (0x06, 0, 0, 0xFFFFFFFF),  # ret #-1: pass
]
_SO_ATTACH_FILTER = 26  # Linux


def _refuse_new_handshakes(listener: socket.socket) -> bool:
    """Drop new SYNs at ``listener`` (their clients retry, and find it closed: a refused connect), while
    handshakes under way complete into its queue. Linux only; False where it cannot be done."""
    import ctypes

    program = b"".join(struct.pack("HBBI", *op) for op in _NO_NEW_HANDSHAKES)
    code = ctypes.create_string_buffer(program)
    fprog = struct.pack("HL", len(_NO_NEW_HANDSHAKES), ctypes.addressof(code))
    try:
        listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
    except OSError:
        return False
    return True


async def _take_backlog(servers: list[Any]) -> list[socket.socket]:
    """Accept every connection the listeners' queues hold, then close the listeners: closing one resets
    what its queue holds, and a busy loop may be far behind. New handshakes are refused first, so
    nothing can slip into a queue between the last accept and the close."""
    taken: list[socket.socket] = []
    queues = [socket.fromfd(listener.fileno(), listener.family, listener.type)  # dups: the same sockets
              for server in servers for listener in server.sockets or ()]  # fmt: skip
    if any([_refuse_new_handshakes(queue) for queue in queues]):
        await asyncio.sleep(HANDSHAKE_SECONDS)  # the handshakes under way land in the queues
    for queue in queues:
        queue.setblocking(False)
        while True:
            try:
                conn, _ = queue.accept()
            except (BlockingIOError, InterruptedError):
                break  # empty
            except OSError as exc:
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue  # one that failed in the queue: the others still wait
                log.error("shutting down: could not take the listener's queue in: %s", exc)
                break
            conn.setblocking(False)
            taken.append(conn)
        queue.close()
    for server in servers:
        server.close()
    return taken


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

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            loop = asyncio.get_running_loop()
            taken = await _take_backlog(self.servers)
            if taken:
                log.warning("shutting down: answering %d connection(s) accepted but not yet taken", len(taken))

            def protocol() -> asyncio.Protocol:  # what uvicorn's startup makes for each connection
                return self.config.http_protocol_class(  # type: ignore[call-arg]
                    config=self.config, server_state=self.server_state, app_state=self.lifespan.state
                )

            for conn in taken:  # each is answered 503: the app is still up and draining
                try:
                    await loop.connect_accepted_socket(protocol, conn, ssl=self.config.ssl)
                except OSError:  # gone meanwhile
                    conn.close()
            await super().shutdown(sockets)

    # The drain ends the requests; uvicorn then only waits for their last bytes.
    config = {"timeout_graceful_shutdown": CLOSE_SECONDS, **config}
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, **config)
    uv_config.load()  # the protocol class is known once loaded: wrap it
    uv_config.http_protocol_class = answering_protocol(uv_config.http_protocol_class)
    DrainingServer(uv_config).run()
