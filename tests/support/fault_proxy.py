"""A TCP proxy on loopback that a test can cut and restore: the network between the gateway and a service.

``FaultProxy(host, port)`` listens on a free loopback port of its own and pipes
every connection to ``host:port``. ``cut()`` resets every connection in flight
and refuses new ones (as a failed database host or a partition that the
kernel reports); ``restore()`` accepts again on the same port. It runs an
asyncio loop on a thread of its own, so the test's blocking code and the
gateway's loop are untouched.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import Any

from servers import free_loopback_socket

_CHUNK = 64 * 1024


class FaultProxy:
    """``start()``, ``cut()``, ``restore()``, ``close()``; ``port`` is where clients connect."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        sock = free_loopback_socket()
        self.port: int = sock.getsockname()[1]
        sock.close()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> FaultProxy:
        self._thread.start()
        self.restore()
        return self

    def restore(self) -> None:
        """Accept connections again (on the same port)."""
        self._call(self._listen())

    def cut(self) -> None:
        """Refuse new connections and reset every open one, both ways."""
        self._call(self._cut())

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._cut())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()

    def _call(self, coro: Any) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port, reuse_address=True)

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            _reset(writer)
        self._writers.clear()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._server is None:  # accepted just before the cut
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(writer)
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(_copy(reader, up_writer), _copy(up_reader, writer), return_exceptions=True)
        for end in (writer, up_writer):
            self._writers.discard(end)
            end.close()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        _reset(writer)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0): the peer sees a reset, as when a host fails, not an orderly FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()
