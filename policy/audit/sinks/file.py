"""The JSON-lines file sink: the spooled lines as they are, so ``inferctl audit verify --file`` checks them.

Each batch is written and fsynced before it counts as delivered; a batch that
fails part-way (a full disk) or a torn tail found on opening (a crash) is cut
back to the last whole line, so the file always verifies. The file
rotates by size: ``audit.jsonl`` becomes ``audit.jsonl.1`` (and ``.1`` becomes
``.2``, ...), keeping ``backups`` old files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from inferflux.policy.audit.spool import SpooledRecord
from inferflux.policy.fileio import fsync_dir, whole_lines_length, write_all


class FileSink:
    def __init__(
        self, path: str | os.PathLike[str], *, max_bytes: int = 100 * 1024 * 1024, backups: int = 10,
        name: str = "file",
    ) -> None:  # fmt: skip
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError("max_bytes must be a positive integer")
        if isinstance(backups, bool) or not isinstance(backups, int) or backups < 0:
            raise ValueError("backups must be a non-negative integer")
        self.name = name
        self.path = Path(path)
        self._max_bytes = max_bytes
        self._backups = backups
        self._fd: int | None = None

    def send(self, records: Sequence[SpooledRecord]) -> None:
        fd = self._open()
        if os.fstat(fd).st_size >= self._max_bytes:
            self._rotate()
            fd = self._open()
        start = os.fstat(fd).st_size
        try:
            write_all(fd, b"".join(r.line + b"\n" for r in records))
            os.fsync(fd)
        except OSError:
            # A full disk wrote part of the batch: cut it off, or the retry would follow half a line.
            os.ftruncate(fd, start)
            raise

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            size = os.fstat(fd).st_size
            whole = whole_lines_length(self.path, size)
            if whole != size:  # the torn tail of a batch a killed gateway was writing; it is delivered again
                os.ftruncate(fd, whole)
            self._fd = fd
        return self._fd

    def _rotate(self) -> None:
        self.close()
        if self._backups == 0:
            self.path.unlink(missing_ok=True)
            return
        for n in range(self._backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{n + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        fsync_dir(self.path.parent)  # the renames, before the new file's records count as delivered

    def rotated_files(self) -> list[Path]:
        """The current file and its backups, oldest first."""
        backups = [self.path.with_name(f"{self.path.name}.{n}") for n in range(self._backups, 0, -1)]
        return [p for p in (*backups, self.path) if p.exists()]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
