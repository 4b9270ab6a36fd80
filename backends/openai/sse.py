"""Server-sent events, read from raw bytes as they arrive.

The fleet reads the upstream's body as bytes (not httpx-sse over decoded
text) for two reasons: it must know when the first body byte arrived, since
retrying is safe only before it, and it passes streams through at high rates,
where splitting bytes once is the cheapest way to find the ``data:`` lines.
Only ``data`` fields matter to an OpenAI stream; comments, ``event``, ``id``
and ``retry`` are skipped.
"""

from __future__ import annotations

from inferflux.backends.openai.errors import UpstreamFailed

MAX_EVENT_BYTES = 8 * 1024 * 1024  # a line or an event beyond this is garbage, not a token chunk


class EventReader:
    """Feeds on byte chunks; gives back each complete event's ``data`` (its lines joined by newlines)."""

    __slots__ = ("_partial", "_data", "_size")

    def __init__(self) -> None:
        self._partial = b""  # the last line, until its newline arrives
        self._data: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        lines = (self._partial + chunk).split(b"\n") if self._partial else chunk.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_EVENT_BYTES:
            raise UpstreamFailed("the upstream sent an oversized stream event")
        events: list[bytes] = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append(self._data[0] if len(self._data) == 1 else b"\n".join(self._data))
                    self._data = []
                    self._size = 0
            elif line.startswith(b"data:"):
                value = line[6:] if line.startswith(b"data: ") else line[5:]
                self._size += len(value)
                if self._size > MAX_EVENT_BYTES:
                    raise UpstreamFailed("the upstream sent an oversized stream event")
                self._data.append(value)
        return events

    def close(self) -> list[bytes]:
        """The event the body ended in the middle of, if any: dispatched as if a blank line had come."""
        return self.feed(b"\n\n") if self._partial or self._data else []
