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

The spool's directory (segments, chain id, sink cursors) is described, read
and written by ``policy.audit.spool_files``; the segments of the live spool
(rotation, a torn tail cut off on open, pruning) are
``policy.audit.spool_segments``; receipts are ``policy.audit.spool_receipts``;
``SpoolSettings`` is ``policy.audit.spool_settings``. This module is the live
writer: the chain's head, what is written and what is durable, the syncer,
health. Segments rotate by size when the syncer finds the current one full.
Readers (the sinks) see only what was fsynced, so no sink can deliver an event
that a crash could still take back. A segment is deleted only when every
sink's cursor is past it and it is older than ``retain_seconds``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from inferflux.policy.audit.chain import sealed_line
from inferflux.policy.audit.errors import AuditUnavailable, SpoolConfigError
from inferflux.policy.audit.events import AuditEvent
from inferflux.policy.audit.spool_files import SEGMENT_SUFFIX, Cursor, CursorFiles, SpooledRecord, lock_directory
from inferflux.policy.audit.spool_files import read_chain_id, read_segments, segment_files
from inferflux.policy.audit.spool_receipts import Receipt, resolve_receipts
from inferflux.policy.audit.spool_segments import Segments
from inferflux.policy.audit.spool_settings import SpoolSettings
from inferflux.policy.fileio import remove_temporaries, write_all

# Cursor, Receipt, SpooledRecord, segment_files, SEGMENT_SUFFIX and SpoolSettings were first defined here;
# importers keep them.
__all__ = ["FAILURE_HOLD_SECONDS", "FREE_CHECK_SECONDS", "SEGMENT_SUFFIX", "Cursor", "Receipt", "Spool",
           "SpoolSettings", "SpoolStats", "SpooledRecord", "segment_files"]

log = logging.getLogger("inferflux.policy.audit")
# After a failed write or fsync the spool reports itself failing this long
# (``health``), so new work is refused; then the next event probes the disk again.
FAILURE_HOLD_SECONDS: Final = 2.0
# The free space of the spool's file system is read at most this often.
FREE_CHECK_SECONDS: Final = 0.25


@dataclass(frozen=True, slots=True)
class SpoolStats:
    events: int  # made durable since open
    batches: int  # fsyncs that made events durable
    fsyncs: int
    pending: int  # written, not yet durable
    failed: int  # events refused by a failed write


class Spool:
    """One replica's audit spool. ``Spool.open(settings)``; ``append`` events; ``close`` at shutdown."""

    def __init__(self, settings: SpoolSettings, chain_id: str, lock_fd: int) -> None:
        """Use ``Spool.open``."""
        self.settings = settings
        self.chain_id = chain_id
        self._dir = settings.directory
        self._files = Segments(self._dir / "segments")
        self._cursors = CursorFiles(self._dir / "cursors")
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
        self._durable, (self._next_seq, self._last_hash) = self._files.recover()
        self._written = self._durable  # where the next line goes
        self._durable_head = (self._next_seq, self._last_hash)  # the chain's head at _durable
        self._thread = threading.Thread(target=self._sync_loop, name="audit-spool-syncer", daemon=True)
        self._thread.start()

    # -- opening

    @classmethod
    def open(cls, settings: SpoolSettings) -> Spool:
        """Open (creating if needed) the spool; SpoolConfigError if it cannot be used."""
        directory = Path(settings.directory).expanduser()
        settings = replace(settings, directory=directory)
        lock_fd = lock_directory(directory)
        try:
            # Only the lock holder writes here, so every temporary file is one a killed writer left.
            for place in (directory, directory / "cursors"):
                remove_temporaries(place)
            return cls(settings, read_chain_id(directory, settings.chain_id), lock_fd)
        except OSError as exc:
            os.close(lock_fd)
            raise SpoolConfigError(f"cannot open the audit spool {directory}: {exc}") from None
        except BaseException:
            os.close(lock_fd)
            raise

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
            resolve_receipts([receipt], [None], AuditUnavailable("The audit spool could not store the event; retry shortly"))
        return receipt

    def _write(self, line: bytes, record: dict[str, Any], receipt: Receipt) -> OSError | None:
        """Write one sealed line at the end of the current segment (the lock held); the error, if any."""
        start = self._written
        try:
            write_all(self._files.fd, line + b"\n")
        except OSError as exc:
            try:  # take back whatever part reached the file, so the chain stays whole
                os.ftruncate(self._files.fd, start.offset)
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
                fd, end = self._files.fd, self._written
                rotated = False
                try:
                    if end.offset >= self.settings.segment_bytes:
                        # The full segment is fsynced first, so the batch is durable already: up to the new one's start.
                        self._written = end = self._files.rotate()
                        rotated = True
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
        os.close(self._files.fd)

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
        resolve_receipts([receipt for _, receipt in batch], [record.seq for record, _ in batch], None)
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
                os.ftruncate(self._files.fd, self._durable.offset)
                self._written = self._durable
            except OSError:
                pass
            self._next_seq, self._last_hash = self._durable_head
            self._pending -= len(failed)
            self._failed += len(failed)
            self._failed_at = time.monotonic()
        resolve_receipts([receipt for _, receipt in failed], [None] * len(failed), error)

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
                stat = os.statvfs(self._files.directory)
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
            durable, segments = self._durable, list(self._files.numbers)
        return read_segments(self._files.directory, segments, durable, cursor, max_records)

    # -- sink cursors and pruning

    def register_sink(self, name: str) -> Cursor:
        """The sink's saved cursor, or (a new sink) the start of the oldest segment present."""
        cursor = self.load_cursor(name)
        if cursor is None:
            with self._state:
                cursor = Cursor(self._files.numbers[0], 0)
            self.save_cursor(name, cursor)
        return cursor

    def load_cursor(self, name: str) -> Cursor | None:
        """The sink's saved cursor; None when it has none, or (logged) an unreadable one."""
        return self._cursors.load(name)

    def save_cursor(self, name: str, cursor: Cursor) -> None:
        """Persist ``cursor`` atomically (see ``CursorFiles.save``)."""
        self._cursors.save(name, cursor)

    def forget_sink(self, name: str) -> None:
        """Drop a sink that is no longer configured, so it stops holding segments back."""
        self._cursors.forget(name)

    def prune(self, now: float | None = None) -> int:
        """Delete segments every sink has delivered (and older than ``retain_seconds``); returns how many."""
        cursors = self._cursors.load_all()
        if not cursors or any(c is None for c in cursors):
            return 0  # no sink has delivered anything, or one must start over: keep everything
        horizon = min(c for c in cursors if c is not None).segment
        now = time.time() if now is None else now
        with self._state:
            candidates = self._files.prunable(horizon, self._durable)
        removed = self._files.delete(candidates, self.settings.retain_seconds, now)
        if removed:
            with self._state:
                self._files.forget(removed)
        return len(removed)

    def segment_paths(self) -> list[Path]:
        with self._state:
            return self._files.paths()
