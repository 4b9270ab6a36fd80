"""Crash-safe file writes: the one helper every file the gateway rewrites goes through.

A file is replaced by writing a temporary file beside it (``.<name>.<random>.tmp``,
created exclusively, mode 0600 whatever the umask), writing *all* of the
bytes (``os.write`` may write fewer than asked), fsyncing it, renaming it over
the target and fsyncing the directory, so the rename itself survives a crash.
A reader, or the process after a ``kill -9`` or a power cut, finds the old
content or the new, never a mix or an empty file. The temporary file is
removed when anything fails (a full disk, a failed fsync); one left by a
process killed mid-write is removed by ``remove_temporaries`` at the next start.

Used for the key file (``policy.store.crypto``), the audit spool's cursors and
chain id (``policy.audit.spool``), the in-process limiter's quota usage
(``policy.ratelimit.memory``) and ``benchmarks/bench_serving.py``'s results.
The append-only files (spool segments, the file sink) are not replaced but
cut back to their last whole line (``whole_lines_length``) after a torn write.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from pathlib import Path

log = logging.getLogger("inferflux.policy")

TEMP_SUFFIX = ".tmp"


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (a write may be partial)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def whole_lines_length(path: Path, size: int) -> int:
    """The length of ``path``'s first ``size`` bytes up to and including their last newline.

    For append-only JSON-lines files: what is after it is a torn line, from a
    crash or a full disk in the middle of a write.
    """
    if size == 0:
        return 0
    with path.open("rb") as f:
        block = 64 * 1024
        end = size
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            chunk = f.read(end - start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                return start + cut + 1
            end = start
    return 0


def fsync_dir(directory: Path) -> None:
    """fsync a directory, so the names created, renamed or removed in it are durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Make ``path`` hold ``data`` (mode 0600) in one step, durably.

    ``exclusive``: create ``path`` only if it does not exist (FileExistsError
    otherwise); the file is linked into place, so of two processes creating it
    at once exactly one wins and nobody reads a half-written file.
    """
    temp = _write_temp(path, data)
    try:
        if exclusive:
            os.link(temp, path)
        else:
            os.replace(temp, path)
    finally:
        # After a replace the name is gone already; after a link (or a failure) this removes it.
        temp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def remove_temporaries(directory: Path, name: str | None = None, older_than: float = 0.0) -> int:
    """Remove temporary files that writes into ``directory`` left behind; returns how many.

    ``name``: only those of that file (else every file's). Call it where no other
    process can be writing there at the same moment (under the spool's lock),
    or give ``older_than`` seconds, so that a write in progress in another
    process, which takes milliseconds, is left alone. A file that cannot be
    removed (a read-only mount) is logged and left.
    """
    target = re.escape(name) if name is not None else ".+"
    # The random part is optional: ".chain.tmp" and ".<name>.<pid>.tmp" are earlier versions' names.
    pattern = re.compile(rf"^\.{target}(\.[0-9a-f]+)?{re.escape(TEMP_SUFFIX)}$")
    removed = 0
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if not pattern.match(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            if older_than and now - entry.stat(follow_symlinks=False).st_mtime < older_than:
                continue
            os.unlink(entry.path)
            removed += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove the temporary file %s: %s", entry.path, exc.strerror or exc)
    return removed


def _write_temp(path: Path, data: bytes) -> Path:
    """Write ``data`` to a fresh 0600 temporary file beside ``path``, fsynced; removed again on failure."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # whatever the umask says
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp
