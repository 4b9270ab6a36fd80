"""The durable audit spool: an append-only, hash-chained log on local disk.

``Spool.append`` seals the event into the chain and writes its line on the
caller's thread (a ``write`` to the page cache: microseconds, and no hand-off)
and returns a ``Receipt``. One syncer thread makes what has been written
durable with one ``fsync`` at a time (group commit: the busier the gateway,
the more events each covers, and with ``sync_interval_seconds`` at most one
fsync per interval) and resolves the receipts it covered, one wake-up per
event loop. Once ``append`` has returned without a failed
receipt, the event's line is in the kernel's page cache: a crash or ``kill -9``
of the process can no longer take it back, only a crash of the machine can,
until the receipt resolves (fsynced). The gateway answers after the first
(``audit.wait_durable: false``, the default) or after the second (``true``);
see ``policy.audit.trail``.

Sealing and writing where the event is made, rather than on a writer thread,
is what keeps the audit trail cheap on the request path: with a writer thread
each event cost the event loop a hand-off and three GIL round trips with that
thread (about 0.25 ms per request on a two-core machine, measured); now the
only hand-off is the fsync's answer. A ``write`` to the page cache blocks only
when the kernel throttles dirty pages, which a disk too slow for the audit
load would cause under either design.

Layout of the spool directory (one per replica; its chain id is its own)::

    chain               the chain id, written once
    lock                flock'ed by the one process writing here
    segments/000000000001.jsonl, ...   records, one JSON line each
    cursors/<sink>.json the next position each sink will deliver

Segments rotate by size when the syncer finds the current one full (the old
one is fsynced before any line goes to the new one). On open a torn tail (bytes after
the last newline, from a crash mid-write) is cut off and the chain continues
from the last record. Readers (the sinks) see only what was fsynced, so no
sink can deliver an event that a crash could still take back. A segment is
deleted only when every sink's cursor is past it and it is older than
``retain_seconds``.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from policy.audit.chain import GENESIS, canonical_json, sealed_line
from policy.audit.errors import AuditUnavailable, SpoolConfigError
from policy.audit.events import AuditEvent
from policy.fileio import fsync_dir, remove_temporaries, whole_lines_length, write_all, write_atomically

log = logging.getLogger("inferflux.policy.audit")

SEGMENT_SUFFIX: Final = ".jsonl"
_SEGMENT_NAME = re.compile(r"^(\d{12})\.jsonl$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# After a failed write or fsync the spool reports itself failing this long
# (``health``), so new work is refused; then the next event probes the disk again.
FAILURE_HOLD_SECONDS: Final = 2.0
# The free space of the spool's file system is read at most this often.
FREE_CHECK_SECONDS: Final = 0.25


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


@dataclass(frozen=True, slots=True)
class SpoolSettings:
    directory: Path
    chain_id: str | None = None  # default: "<hostname>-<random>", chosen when the spool is created
    segment_bytes: int = 64 * 1024 * 1024
    max_pending: int = 100_000  # written, not yet durable; beyond it append() refuses (503)
    retain_seconds: float = 0.0  # keep delivered segments at least this long
    # The least time between two fsyncs. 0: fsync as soon as anything is written
    # (for callers that wait for their receipt). More: each fsync covers what the
    # interval gathered, so a steady trickle of events wakes the syncer (whose
    # GIL round trips slow the request path) once per interval, not per event.
    sync_interval_seconds: float = 0.0
    # Below this much free space on the spool's file system ``health`` says
    # "disk_low", so the gateway refuses new work while events still fit (0: off).
    min_free_bytes: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.min_free_bytes, bool) or not isinstance(self.min_free_bytes, int) or self.min_free_bytes < 0:
            raise SpoolConfigError("audit spool min_free_bytes must be a non-negative integer")
        for name in ("segment_bytes", "max_pending"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpoolConfigError(f"audit spool {name} must be a positive integer")
        for name in ("retain_seconds", "sync_interval_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise SpoolConfigError(f"audit spool {name} must be a non-negative number")
        if self.chain_id is not None and not _NAME.match(self.chain_id):
            raise SpoolConfigError("audit chain_id must be 1-64 characters of A-Z, a-z, 0-9, '.', '_', '-'")


@dataclass(frozen=True, slots=True)
class SpoolStats:
    events: int  # made durable since open
    batches: int  # fsyncs that made events durable
    fsyncs: int
    pending: int  # written, not yet durable
    failed: int  # events refused by a failed write


class Receipt:
    """The acknowledgement of one appended event: resolves once it is durable (fsynced), or failed.

    ``wait()`` from a thread, ``await receipt`` from asyncio. A failed receipt
    raises ``AuditUnavailable``. One is made per request, and most are never
    waited for: the event a waiting thread blocks on is made only when one does.
    """

    __slots__ = ("event_id", "seq", "_done", "_error", "_lock", "_waiters", "_event")

    def __init__(self, event_id: str) -> None:
        self.event_id = event_id
        self.seq: int | None = None
        self._done = False
        self._error: AuditUnavailable | None = None
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._event: threading.Event | None = None  # for threads in wait()

    def done(self) -> bool:
        return self._done

    def raise_if_failed(self) -> None:
        """AuditUnavailable if the event is already known lost (its write failed); never waits."""
        if self._done and self._error is not None:
            raise self._error

    def wait(self, timeout: float | None = None) -> bool:
        """True once durable, False on timeout; raises AuditUnavailable if the write failed."""
        with self._lock:
            if not self._done and self._event is None:
                self._event = threading.Event()
            event = self._event
        if event is not None and not event.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True

    async def durable(self) -> None:
        with self._lock:
            if not self._done:
                loop = asyncio.get_running_loop()
                future: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, future))
            else:
                future = None  # type: ignore[assignment]
        if future is not None:
            await future
        if self._error is not None:
            raise self._error

    def __await__(self) -> Any:
        return self.durable().__await__()

    def _resolve(self, seq: int | None, error: AuditUnavailable | None) -> None:
        _resolve_all([self], [seq], error)

    def _settle(self, seq: int | None, error: AuditUnavailable | None) -> list[tuple[Any, Any]]:
        """Resolve, waking waiting threads but not event loops; the loops' waiters to wake."""
        with self._lock:
            self.seq, self._error = seq, error
            self._done = True
            waiters, self._waiters = self._waiters, []
            event = self._event
        if event is not None:
            event.set()
        return waiters


def _resolve_all(receipts: Sequence[Receipt], seqs: Sequence[int | None], error: AuditUnavailable | None) -> None:
    """Resolve ``receipts``, waking each waiting event loop once for all of its receipts."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
    for receipt, seq in zip(receipts, seqs, strict=True):
        for loop, future in receipt._settle(seq, error):
            by_loop.setdefault(loop, []).append(future)
    for loop, futures in by_loop.items():
        try:
            loop.call_soon_threadsafe(_finish, futures)
        except RuntimeError:  # that loop is closed: nobody is waiting any more
            pass


def _finish(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)


class Spool:
    """One replica's audit spool. ``Spool.open(settings)``; ``append`` events; ``close`` at shutdown."""

    def __init__(self, settings: SpoolSettings, chain_id: str, lock_fd: int) -> None:
        """Use ``Spool.open``."""
        self.settings = settings
        self.chain_id = chain_id
        self._dir = settings.directory
        self._segments_dir = self._dir / "segments"
        self._cursors_dir = self._dir / "cursors"
        self._lock_fd = lock_fd
        lock = threading.Lock()  # guards the fields below, the chain's head and the file
        self._state = threading.Condition(lock)  # notified when data becomes durable
        self._written_more = threading.Condition(lock)  # notified when there is something to fsync
        self._unsynced: list[tuple[SpooledRecord, Receipt]] = []  # written, in order, not yet fsynced
        self._pending = 0
        self._closed = False
        self._events = self._batches = self._fsyncs = self._failed = 0
        self._failed_at = self._ok_at = float("-inf")  # monotonic: the last failed / successful write
        self._free, self._free_at = 0, float("-inf")
        self._listeners: list[Callable[[Sequence[SpooledRecord]], None]] = []
        segments = _list_segments(self._segments_dir)
        self._segments: list[int] = segments or [1]
        self._next_seq, self._last_hash = 0, GENESIS
        self._fd = -1
        self._durable = Cursor(self._segments[-1], 0)
        self._recover()
        self._written = self._durable  # where the next line goes
        self._durable_head = (self._next_seq, self._last_hash)  # the chain's head at _durable
        self._thread = threading.Thread(target=self._sync_loop, name="audit-spool-syncer", daemon=True)
        self._thread.start()

    # -- opening

    @classmethod
    def open(cls, settings: SpoolSettings) -> Spool:
        """Open (creating if needed) the spool; SpoolConfigError if it cannot be used."""
        directory = Path(settings.directory).expanduser()
        settings = SpoolSettings(**{**_fields(settings), "directory": directory})
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
        try:
            # Only the lock holder writes here, so every temporary file is one a killed writer left.
            for place in (directory, directory / "cursors"):
                remove_temporaries(place)
            return cls(settings, _chain_id(directory, settings.chain_id), lock_fd)
        except OSError as exc:
            os.close(lock_fd)
            raise SpoolConfigError(f"cannot open the audit spool {directory}: {exc}") from None
        except BaseException:
            os.close(lock_fd)
            raise

    def _recover(self) -> None:
        """Cut a torn tail off the newest segment and find the chain's head."""
        newest = self._segments[-1]
        path = self._segment_path(newest)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        size = os.fstat(self._fd).st_size
        good = whole_lines_length(path, size)
        if good != size:
            log.warning("audit spool: cut %d bytes of a torn record off %s", size - good, path.name)
            os.ftruncate(self._fd, good)
        os.fsync(self._fd)
        fsync_dir(self._segments_dir)
        self._durable = Cursor(newest, good)
        for number in reversed(self._segments):
            head = _last_record(self._segment_path(number))
            if head is not None:
                self._next_seq, self._last_hash = head["seq"] + 1, head["hash"]
                break

    # -- writing

    def append(self, event: AuditEvent) -> Receipt:
        """Seal ``event`` into the chain and write it; the receipt resolves when it is durable.

        Never waits for the disk. Raises AuditUnavailable when the spool is
        closed or ``max_pending`` events already wait for their fsync (the disk
        cannot keep up): the caller should then refuse the request rather than
        serve it unaudited. An event that cannot be written (not JSON, a failed
        write) gets a failed receipt and takes no place in the chain.
        """
        if not isinstance(event, AuditEvent):
            raise TypeError("append() takes an AuditEvent")
        receipt = Receipt(event.id)
        with self._state:
            if self._closed:
                raise AuditUnavailable("The audit spool is closed")
            if self._pending >= self.settings.max_pending:
                raise AuditUnavailable("The audit spool is behind; retry shortly")
            try:
                record, line = sealed_line(self.chain_id, self._next_seq, self._last_hash, event.to_json())
            except (TypeError, ValueError) as exc:  # not JSON (a lone surrogate, say): refuse this one only
                failed: Exception | None = exc
            else:
                failed = self._write(line, record, receipt)
            if failed is None:
                self._pending += 1
                self._written_more.notify()
        if failed is not None:
            log.error("audit spool: an event could not be written: %s", failed)
            with self._state:
                self._failed += 1
                if isinstance(failed, OSError):  # the disk, not the event
                    self._failed_at = time.monotonic()
            receipt._resolve(None, AuditUnavailable("The audit spool could not store the event; retry shortly"))
        return receipt

    def _write(self, line: bytes, record: dict[str, Any], receipt: Receipt) -> OSError | None:
        """Write one sealed line at the end of the current segment (the lock held); the error, if any."""
        start = self._written
        try:
            write_all(self._fd, line + b"\n")
        except OSError as exc:
            try:  # take back whatever part reached the file, so the chain stays whole
                os.ftruncate(self._fd, start.offset)
            except OSError:
                pass
            return exc
        self._written = Cursor(start.segment, start.offset + len(line) + 1)
        if self._failed_at > self._ok_at:  # a write after a failure: the disk takes events again
            self._ok_at = time.monotonic()
        self._unsynced.append((SpooledRecord(line, record, self._written), receipt))
        self._next_seq, self._last_hash = record["seq"] + 1, record["hash"]
        return None

    def _sync_loop(self) -> None:
        while True:
            with self._state:
                while not self._unsynced and not self._closed:
                    self._written_more.wait()
                if not self._unsynced:
                    break  # closed, and everything written is durable
                batch, self._unsynced = self._unsynced, []
                fd, end = self._fd, self._written
                rotated = False
                try:
                    if end.offset >= self.settings.segment_bytes:
                        self._rotate()  # fsyncs the full segment, so the batch is durable already
                        rotated, end = True, self._written  # durable up to the new segment's start
                except OSError as exc:
                    log.error("audit spool: cannot start a new segment (%s); the current one grows", exc)
            try:
                if not rotated:
                    os.fsync(fd)
            except OSError as exc:
                self._fail(batch, exc)
                continue
            self._made_durable(batch, end)
            self._rest()
        os.close(self._fd)

    def _rest(self) -> None:
        """Let ``sync_interval_seconds`` pass before the next fsync (not when closing: close flushes at once)."""
        interval = self.settings.sync_interval_seconds
        if interval > 0:
            with self._state:
                self._state.wait_for(lambda: self._closed, interval)

    def _made_durable(self, batch: list[tuple[SpooledRecord, Receipt]], end: Cursor) -> None:
        last = batch[-1][0]
        with self._state:
            self._durable = end
            self._durable_head = (last.record["seq"] + 1, last.record["hash"])
            self._pending -= len(batch)
            self._events += len(batch)
            self._batches += 1
            self._fsyncs += 1
            self._state.notify_all()
            listeners = list(self._listeners)
        _resolve_all([receipt for _, receipt in batch], [record.seq for record, _ in batch], None)
        records = [record for record, _ in batch]
        for listener in listeners:
            try:
                listener(records)
            except Exception:  # a listener (the live tail) must never stop the syncer
                log.exception("audit spool listener failed")

    def _fail(self, batch: list[tuple[SpooledRecord, Receipt]], exc: Exception) -> None:
        """An fsync failed: nothing written since the last durable point can be trusted to be on disk.

        Everything after it is cut off (what was written after this batch too),
        the chain goes back to its durable head, and every receipt cut off fails.
        (The durable point is always in the current segment: a rotation makes
        the old one durable and moves it to the new one's start.)
        """
        log.error("audit spool: making %d events durable failed: %s", len(batch), exc)
        error = AuditUnavailable("The audit spool could not store the event; retry shortly")
        with self._state:
            later, self._unsynced = self._unsynced, []
            failed = batch + later
            try:
                os.ftruncate(self._fd, self._durable.offset)
                self._written = self._durable
            except OSError:
                pass
            self._next_seq, self._last_hash = self._durable_head
            self._pending -= len(failed)
            self._failed += len(failed)
            self._failed_at = time.monotonic()
        _resolve_all([receipt for _, receipt in failed], [None] * len(failed), error)

    def _rotate(self) -> None:
        """Start the next segment (the lock held): the current one is made durable and closed first."""
        os.fsync(self._fd)
        number = self._segments[-1] + 1
        fd = os.open(self._segment_path(number), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o600)
        fsync_dir(self._segments_dir)
        old, self._fd = self._fd, fd
        os.close(old)
        self._segments.append(number)
        self._written = Cursor(number, 0)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, stop the writer and release the directory."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._state.notify_all()
            self._written_more.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("audit spool syncer did not stop within %.0fs", timeout)
        os.close(self._lock_fd)

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> str | None:
        """Why the spool should not be given new work now, or None.

        "closed", "behind" (``max_pending`` events wait for their fsync),
        "failing" (a write or fsync failed in the last ``FAILURE_HOLD_SECONDS``
        and none has succeeded since) or "disk_low" (less than
        ``min_free_bytes`` free). The gateway checks it before it starts work
        whose answer will need an event (a stream, an admin change), since a
        stream's status is sent before its event can be written.
        """
        now = time.monotonic()
        with self._state:
            if self._closed:
                return "closed"
            if self._pending >= self.settings.max_pending:
                return "behind"
            if self._failed_at > self._ok_at and now - self._failed_at < FAILURE_HOLD_SECONDS:
                return "failing"
        if self.settings.min_free_bytes and self.free_bytes() < self.settings.min_free_bytes:
            return "disk_low"
        return None

    def free_bytes(self) -> int:
        """Bytes free for this process on the spool's file system (read at most every ``FREE_CHECK_SECONDS``)."""
        now = time.monotonic()
        if now - self._free_at >= FREE_CHECK_SECONDS:
            try:
                stat = os.statvfs(self._segments_dir)
                self._free = stat.f_bavail * stat.f_frsize
            except OSError:
                self._free = 0
            self._free_at = now
        return self._free

    @property
    def closed(self) -> bool:
        with self._state:
            return self._closed

    @property
    def stats(self) -> SpoolStats:
        with self._state:
            return SpoolStats(self._events, self._batches, self._fsyncs, self._pending, self._failed)

    def add_listener(self, listener: Callable[[Sequence[SpooledRecord]], None]) -> None:
        """Call ``listener(records)`` on the writer thread after each durable batch; it must not block."""
        with self._state:
            self._listeners.append(listener)

    # -- reading

    def durable_cursor(self) -> Cursor:
        with self._state:
            return self._durable

    def durable_head(self) -> tuple[int, str]:
        """The seq and hash of the last durable record (-1 and the genesis hash when there is none)."""
        with self._state:
            next_seq, digest = self._durable_head
        return next_seq - 1, digest

    def wait_beyond(self, cursor: Cursor, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for durable records after ``cursor``; whether there are some."""
        deadline = time.monotonic() + timeout
        with self._state:
            while self._durable <= cursor and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._state.wait(left)
            return self._durable > cursor

    def read(self, cursor: Cursor, max_records: int = 500, wait: float = 0.0) -> tuple[list[SpooledRecord], Cursor]:
        """Durable records after ``cursor`` (waiting up to ``wait`` seconds for some) and the cursor after them."""
        if wait > 0:
            self.wait_beyond(cursor, wait)
        with self._state:
            durable, segments = self._durable, list(self._segments)
        while cursor < durable:
            if cursor.segment not in segments:
                later = [n for n in segments if n > cursor.segment]
                if not later:
                    break
                log.warning("audit spool: segment %d is gone; a reader skips to %d", cursor.segment, later[0])
                cursor = Cursor(later[0], 0)
                continue
            path = self._segment_path(cursor.segment)
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

    # -- sink cursors and pruning

    def register_sink(self, name: str) -> Cursor:
        """The sink's saved cursor, or (a new sink) the start of the oldest segment present."""
        cursor = self.load_cursor(name)
        if cursor is None:
            with self._state:
                cursor = Cursor(self._segments[0], 0)
            self.save_cursor(name, cursor)
        return cursor

    def load_cursor(self, name: str) -> Cursor | None:
        path = self._cursor_path(name)
        try:
            data = json.loads(path.read_bytes())
            return Cursor(int(data["segment"]), int(data["offset"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Re-delivering is safe (at-least-once); skipping is not: start over from the oldest segment.
            log.error("audit spool: cursor of sink %s is unreadable (%s); it restarts at the oldest segment", name, exc)
            return None

    def save_cursor(self, name: str, cursor: Cursor) -> None:
        """Persist ``cursor`` atomically: a crash leaves the old or the new one, never a torn one.

        On a full disk it raises and leaves no temporary file behind.
        """
        write_atomically(self._cursor_path(name), canonical_json({"segment": cursor.segment, "offset": cursor.offset}))

    def forget_sink(self, name: str) -> None:
        """Drop a sink that is no longer configured, so it stops holding segments back."""
        self._cursor_path(name).unlink(missing_ok=True)

    def prune(self, now: float | None = None) -> int:
        """Delete segments every sink has delivered (and older than ``retain_seconds``); returns how many."""
        cursors = [self.load_cursor(p.stem) for p in self._cursors_dir.glob("*.json")]
        if not cursors or any(c is None for c in cursors):
            return 0  # no sink has delivered anything, or one must start over: keep everything
        horizon = min(c for c in cursors if c is not None).segment
        now = time.time() if now is None else now
        with self._state:
            newest_with_data = self._segments[-1] if self._durable.offset else self._segments[-2:][0]
            candidates = [n for n in self._segments if n < horizon and n < newest_with_data]
        removed = []
        for number in candidates:
            path = self._segment_path(number)
            try:
                if now - path.stat().st_mtime < self.settings.retain_seconds:
                    break  # segments are in time order: later ones are younger still
                path.unlink()
            except FileNotFoundError:
                pass
            removed.append(number)
        if removed:
            fsync_dir(self._segments_dir)
            with self._state:
                self._segments = [n for n in self._segments if n not in removed]
        return len(removed)

    def segment_paths(self) -> list[Path]:
        with self._state:
            return [self._segment_path(n) for n in self._segments]

    def _segment_path(self, number: int) -> Path:
        return self._segments_dir / f"{number:012d}{SEGMENT_SUFFIX}"

    def _cursor_path(self, name: str) -> Path:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError("a sink name must be 1-64 characters of A-Z, a-z, 0-9, '.', '_', '-'")
        return self._cursors_dir / f"{name}.json"


# -- files ----------------------------------------------------------------------


def segment_files(directory: Path) -> list[Path]:
    """A spool directory's segments, oldest first (for verification; takes no lock)."""
    segments = Path(directory) / "segments"
    return [segments / f"{n:012d}{SEGMENT_SUFFIX}" for n in _list_segments(segments)]


def _list_segments(directory: Path) -> list[int]:
    numbers = []
    for path in directory.iterdir() if directory.is_dir() else ():
        match = _SEGMENT_NAME.match(path.name)
        if match:
            numbers.append(int(match.group(1)))
    return sorted(numbers)


def _chain_id(directory: Path, wanted: str | None) -> str:
    path = directory / "chain"
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = None
    if existing is not None:
        if not _NAME.match(existing):
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


def _last_record(path: Path) -> dict[str, Any] | None:
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


def _fields(settings: SpoolSettings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in SpoolSettings.__dataclass_fields__}
