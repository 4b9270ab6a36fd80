"""One grammar worker process (``grammar_worker.py``) as its parent sees it.

``GrammarSandbox`` starts these, sends each a grammar as one length-prefixed
JSON message and waits for the answer, reading the worker's CPU time and
resident memory from /proc meanwhile so that it can kill the worker the moment
a budget is spent. The worker runs isolated (``python -I``) in a session of its
own, so a kill reaches nothing else.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import time
from typing import IO, Any, cast

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grammar_worker.py")
_HEADER = struct.Struct(">I")  # each message's length, before its JSON (grammar_worker.py reads the same)
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class WorkerProcess:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-I", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     close_fds=True, start_new_session=True)  # fmt: skip
        self.vocabularies: set[str] = set()
        self._buffer = bytearray()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, message: dict[str, Any]) -> None:
        body = json.dumps(message).encode()
        stdin = cast(IO[bytes], self.proc.stdin)  # a pipe: Popen made it
        stdin.write(_HEADER.pack(len(body)) + body)
        stdin.flush()

    def receive(self, timeout: float) -> dict[str, Any] | None:
        """The next message, or None if none came within ``timeout``; EOFError if the worker is gone."""
        fd = cast(IO[bytes], self.proc.stdout).fileno()
        deadline = time.monotonic() + timeout
        while True:
            if len(self._buffer) >= _HEADER.size:
                (length,) = _HEADER.unpack_from(self._buffer)
                if len(self._buffer) >= _HEADER.size + length:
                    body = bytes(self._buffer[_HEADER.size : _HEADER.size + length])
                    del self._buffer[: _HEADER.size + length]
                    message: dict[str, Any] = json.loads(body)
                    return message
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buffer += chunk

    def usage(self) -> tuple[float, int] | None:
        """CPU seconds and resident bytes so far, from /proc; None where there is none."""
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{self.pid}/statm", "rb") as f:
                resident = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            return None
        # after the command's ")": state is field 3 of stat(5), utime and stime fields 14 and 15
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS, resident * _PAGE

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
