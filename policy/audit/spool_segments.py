"""The live spool's segment files: which are present, the newest that takes the writes, rotation and pruning.

``Segments`` holds what ``Spool`` knows of its ``segments/`` directory: the
numbers present, oldest first, and the open descriptor of the newest. On open
(``recover``) a torn tail (bytes after the last newline, from a crash
mid-write) is cut off the newest, and the chain's head is read from the last
record. ``rotate`` makes the current segment durable before the next one takes
a line; ``prunable`` and ``delete`` drop what every sink has delivered.

It has no lock of its own: once the syncer runs, the spool calls it with its
lock held, except for ``delete`` (which touches files only) and the syncer's
fsync of ``fd``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from inferflux.policy.audit.chain import GENESIS
from inferflux.policy.audit.spool_files import Cursor, last_record, list_segments, segment_path
from inferflux.policy.fileio import fsync_dir, whole_lines_length

log = logging.getLogger("inferflux.policy.audit")


class Segments:
    """The segments of one spool directory; ``recover`` before the first write."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.numbers: list[int] = list_segments(directory) or [1]
        self.fd = -1  # the newest segment, opened for appending

    def path(self, number: int) -> Path:
        return segment_path(self.directory, number)

    def paths(self) -> list[Path]:
        return [self.path(n) for n in self.numbers]

    def recover(self) -> tuple[Cursor, tuple[int, str]]:
        """Open the newest segment, cut a torn tail off it; its end, and the chain's next seq and last hash."""
        newest = self.numbers[-1]
        path = self.path(newest)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        size = os.fstat(self.fd).st_size
        good = whole_lines_length(path, size)
        if good != size:
            log.warning("audit spool: cut %d bytes of a torn record off %s", size - good, path.name)
            os.ftruncate(self.fd, good)
        os.fsync(self.fd)
        fsync_dir(self.directory)
        for number in reversed(self.numbers):
            head = last_record(self.path(number))
            if head is not None:
                return Cursor(newest, good), (head["seq"] + 1, head["hash"])
        return Cursor(newest, good), (0, GENESIS)

    def rotate(self) -> Cursor:
        """Start the next segment (the current one is made durable and closed first); the cursor at its start."""
        os.fsync(self.fd)
        number = self.numbers[-1] + 1
        fd = os.open(self.path(number), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o600)
        fsync_dir(self.directory)
        old, self.fd = self.fd, fd
        os.close(old)
        self.numbers.append(number)
        return Cursor(number, 0)

    def prunable(self, horizon: int, durable: Cursor) -> list[int]:
        """The segments before ``horizon`` (the sinks' oldest cursor), never the newest that holds records."""
        newest_with_data = self.numbers[-1] if durable.offset else self.numbers[-2:][0]
        return [n for n in self.numbers if n < horizon and n < newest_with_data]

    def delete(self, candidates: list[int], retain_seconds: float, now: float) -> list[int]:
        """Delete ``candidates`` (oldest first) older than ``retain_seconds``; the numbers gone (``forget`` them)."""
        removed = []
        for number in candidates:
            path = self.path(number)
            try:
                if now - path.stat().st_mtime < retain_seconds:
                    break  # segments are in time order: later ones are younger still
                path.unlink()
            except FileNotFoundError:
                pass
            removed.append(number)
        if removed:
            fsync_dir(self.directory)
        return removed

    def forget(self, removed: list[int]) -> None:
        self.numbers = [n for n in self.numbers if n not in removed]
