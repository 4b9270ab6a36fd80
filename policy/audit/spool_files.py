"""The audit spool's directory as files: segments of records, the chain id, the sinks' cursors.

Layout (one directory per replica; its chain id is its own)::

    chain               the chain id, written once
    lock                flock'ed by the one process writing here
    segments/000000000001.jsonl, ...   records, one JSON line each
    cursors/<sink>.json the next position each sink will deliver

Everything here reads or writes files and holds no state of its own: which
part of a segment is durable, and so may be read, is the live ``Spool``'s
knowledge (``policy.audit.spool``), passed in by it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from inferflux.policy.audit.chain import canonical_json
from inferflux.policy.audit.errors import SpoolConfigError
from inferflux.policy.fileio import write_atomically

log = logging.getLogger("inferflux.policy.audit")

SEGMENT_SUFFIX: Final = ".jsonl"
_SEGMENT_NAME = re.compile(r"^(\d{12})\.jsonl$")
# A chain id or a sink name: safe as a file name and in a syslog header.
NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True, slots=True, order=True)
class Cursor:
    """A position in the spool: a segment number and a byte offset in it."""

    segment: int
    offset: int


@dataclass(frozen=True, slots=True)
class SpooledRecord:
    """One durable record as a sink sees it: the exact line (no newline) and its parsed JSON."""

    line: bytes
    record: dict[str, Any]
    cursor: Cursor  # the position just after this record

    @property
    def event(self) -> dict[str, Any]:
        event = self.record.get("event")
        return event if isinstance(event, dict) else {}

    @property
    def chain(self) -> str | None:
        return self.record.get("chain")

    @property
    def seq(self) -> int | None:
        return self.record.get("seq")


# -- the directory ---------------------------------------------------------------


def lock_directory(directory: Path) -> int:
    """Create the spool's directories (owner-only) and take its lock; the lock's fd, closed by the caller.

    One process writes a spool: a second one (another replica pointed at the
    same directory) is refused rather than left to interleave its chain.
    """
    try:
        for path in (directory, directory / "segments", directory / "cursors"):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise SpoolConfigError(f"cannot use the audit spool directory {directory}: {exc.strerror}") from None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(lock_fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise SpoolConfigError(
                f"the audit spool {directory} is in use by another process; each replica needs its own"
            ) from None
        raise SpoolConfigError(f"cannot lock the audit spool {directory}: {exc.strerror}") from None
    return lock_fd


# -- segments -------------------------------------------------------------------


def segment_files(directory: Path) -> list[Path]:
    """A spool directory's segments, oldest first (for verification; takes no lock)."""
    segments = Path(directory) / "segments"
    return [segment_path(segments, n) for n in list_segments(segments)]


def segment_path(segments_dir: Path, number: int) -> Path:
    return segments_dir / f"{number:012d}{SEGMENT_SUFFIX}"


def list_segments(directory: Path) -> list[int]:
    """The numbers of the segments in ``directory``, in order."""
    numbers = []
    for path in directory.iterdir() if directory.is_dir() else ():
        match = _SEGMENT_NAME.match(path.name)
        if match:
            numbers.append(int(match.group(1)))
    return sorted(numbers)


def last_record(path: Path) -> dict[str, Any] | None:
    """The last line of ``path`` that reads as a record with a seq and hash (the chain's head)."""
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("seq"), int) and isinstance(record.get("hash"), str):
            return record
        log.error("audit spool: %s ends with an unreadable record; the chain continues from an earlier one", path.name)
    return None


def read_segments(
    segments_dir: Path, segments: list[int], durable: Cursor, cursor: Cursor, max_records: int
) -> tuple[list[SpooledRecord], Cursor]:
    """Up to ``max_records`` records after ``cursor`` and below ``durable``, and the cursor after them.

    A reader whose segment was pruned under it skips to the next one present.
    """
    while cursor < durable:
        if cursor.segment not in segments:
            later = [n for n in segments if n > cursor.segment]
            if not later:
                break
            log.warning("audit spool: segment %d is gone; a reader skips to %d", cursor.segment, later[0])
            cursor = Cursor(later[0], 0)
            continue
        path = segment_path(segments_dir, cursor.segment)
        end = durable.offset if cursor.segment == durable.segment else _size(path)
        if cursor.offset < end:
            records = _read_records(path, cursor, end, max_records)
            if records:
                return records, records[-1].cursor
        following = [n for n in segments if n > cursor.segment]
        if not following:
            break
        cursor = Cursor(following[0], 0)
    return [], cursor


def _read_records(path: Path, cursor: Cursor, end: int, max_records: int) -> list[SpooledRecord]:
    records: list[SpooledRecord] = []
    with path.open("rb") as f:
        f.seek(cursor.offset)
        offset = cursor.offset
        while offset < end and len(records) < max_records:
            line = f.readline(end - offset)
            if not line.endswith(b"\n"):
                break  # cannot happen below the durable mark, but never hand out half a line
            offset += len(line)
            line = line[:-1]
            try:
                parsed = json.loads(line)
            except ValueError:
                parsed = None
            # A damaged line is still delivered as it is: verification, not delivery, judges it.
            record = parsed if isinstance(parsed, dict) else {}
            records.append(SpooledRecord(line, record, Cursor(cursor.segment, offset)))
    return records


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


# -- the chain id ---------------------------------------------------------------


def read_chain_id(directory: Path, wanted: str | None) -> str:
    """The spool's chain id, chosen (``wanted``, else "<hostname>-<random>") and written on first use."""
    path = directory / "chain"
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = None
    if existing is not None:
        if not NAME.match(existing):
            raise SpoolConfigError(f"{path} does not hold a valid chain id")
        if wanted is not None and wanted != existing:
            raise SpoolConfigError(
                f"the audit spool {directory} belongs to chain {existing!r}, not {wanted!r}; "
                "use another directory for another chain"
            )
        return existing
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "gateway"
    chain = wanted or f"{host}-{secrets.token_hex(4)}"
    write_atomically(path, (chain + "\n").encode())  # fsynced: an empty chain file would stop every start
    return chain


# -- sink cursors ---------------------------------------------------------------


class CursorFiles:
    """The sinks' cursors, one small JSON file each, replaced atomically."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory

    def load(self, name: str) -> Cursor | None:
        path = self._path(name)
        try:
            data = json.loads(path.read_bytes())
            return Cursor(int(data["segment"]), int(data["offset"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Re-delivering is safe (at-least-once); skipping is not: start over from the oldest segment.
            log.error("audit spool: cursor of sink %s is unreadable (%s); it restarts at the oldest segment", name, exc)
            return None

    def load_all(self) -> list[Cursor | None]:
        """Every saved sink's cursor (None for one that cannot be read)."""
        return [self.load(p.stem) for p in self._dir.glob("*.json")]

    def save(self, name: str, cursor: Cursor) -> None:
        """Persist ``cursor`` atomically: a crash leaves the old or the new one, never a torn one.

        On a full disk it raises and leaves no temporary file behind.
        """
        write_atomically(self._path(name), canonical_json({"segment": cursor.segment, "offset": cursor.offset}))

    def forget(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def _path(self, name: str) -> Path:
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError("a sink name must be 1-64 characters of A-Z, a-z, 0-9, '.', '_', '-'")
        return self._dir / f"{name}.json"
