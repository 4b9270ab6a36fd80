"""A progress line for long operations (model loads, audit walks): on stderr, and only on a terminal.

Redirected output, ``--json`` and pipes never see it, so what a script reads
is unchanged. The line is redrawn in place with a spinner and the latest
stage, and cleared when the operation ends.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

_FRAMES = "|/-\\"


class Progress:
    """``with Progress("loading x") as p: p.update("stage")``; draws only when ``enabled`` and stderr is a TTY."""

    def __init__(self, title: str, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.title = title
        self.enabled = enabled and self.stream.isatty()
        self.started = time.monotonic()
        self._frame = 0
        self._width = 0

    def update(self, stage: str) -> None:
        if not self.enabled:
            return
        self._frame += 1
        line = f"{_FRAMES[self._frame % len(_FRAMES)]} {self.title}: {stage} [{time.monotonic() - self.started:.0f} s]"
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
