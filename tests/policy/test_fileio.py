"""Crash safety of every file the gateway rewrites: the key file, the spool's cursors and chain id,
the quota usage. Partial writes are finished, a full disk leaves no temporary file, a restart
sweeps what a killed writer left, and a writer killed at random points leaves only whole files."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from audit_support import make_event

from inferflux.policy.audit.cli import verify_files, verify_spool
from inferflux.policy.audit.sinks.file import FileSink
from inferflux.policy.audit.spool import Cursor, Spool, SpoolSettings
from inferflux.policy.ratelimit import MemoryBackend
from inferflux.policy.ratelimit.memory import STATE_FILE
from inferflux.policy.store.crypto import KeyFile, create_key_file, new_key, read_key_file, replace_key_file

WRITER = Path(__file__).with_name("fileio_writer.py")
SUPPORT = Path(__file__).parents[1] / "support"
KILLS = 30


def temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*.tmp"))


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[bool]:
    """A small tmpfs at ``path`` if this process may mount one (root); yields whether it did."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], capture_output=True
    ).returncode == 0 if os.geteuid() == 0 else False  # fmt: skip
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Callable[[int], None]]]:
    """A directory and ``fill(leave)``, after which only ``leave`` more bytes fit there (ENOSPC after).

    As root: a 1 MiB tmpfs, filled for real (creating an empty file still works
    on a full tmpfs, as on most file systems: exactly how the empty temporaries
    were left). Otherwise (CI runs unprivileged) ``os.write`` to a file under
    the directory writes what is left of ``leave`` and then raises ENOSPC.
    """
    directory = tmp_path / "disk"
    with _tmpfs(directory, "1m") as mounted:
        if mounted:
            def fill(leave: int) -> None:
                fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    while os.write(fd, b"\0" * 4096):
                        pass
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))  # tmpfs frees whole pages
                finally:
                    os.close(fd)
        else:
            real_write = os.write

            def fill(leave: int) -> None:
                room = [leave]

                def write(fd: int, data: bytes) -> int:
                    if not os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory)):
                        return real_write(fd, data)
                    if not room[0]:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    written = real_write(fd, bytes(data[: room[0]]))
                    room[0] -= written
                    return written

                monkeypatch.setattr(os, "write", write)
        yield directory, fill


@pytest.fixture
def short_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.write`` writes at most 7 bytes per call, as it may (a signal, a nearly full disk, a pipe)."""
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))


# -- partial writes


def test_the_key_file_survives_short_writes(tmp_path: Path, short_writes: None) -> None:
    path = tmp_path / "store.key"
    first = KeyFile(active=1, keys={1: new_key()})
    create_key_file(path, first)
    assert read_key_file(path) == first
    second = first.with_key(2, new_key())
    replace_key_file(path, second)
    assert read_key_file(path) == second


def test_cursors_and_quota_usage_survive_short_writes(tmp_path: Path, short_writes: None) -> None:
    with Spool.open(SpoolSettings(tmp_path / "spool", chain_id="gw-short")) as spool:
        spool.save_cursor("siem", Cursor(12, 3456))
        assert spool.load_cursor("siem") == Cursor(12, 3456)
    backend = MemoryBackend(tmp_path)
    backend._quotas["q:ten_a"] = [700, time.time() + 3600]
    backend._dirty = True
    backend.persist()
    assert json.loads((tmp_path / STATE_FILE).read_text())["quotas"]["q:ten_a"][0] == 700


# -- a full disk


def test_a_full_disk_leaves_no_temporary_cursor(full_disk: tuple[Path, Callable[[int], None]]) -> None:
    directory, fill = full_disk
    with Spool.open(SpoolSettings(directory / "spool", chain_id="gw-full")) as spool:
        spool.save_cursor("siem", Cursor(1, 10))
        fill(0)
        for offset in range(20, 30):
            with pytest.raises(OSError) as failure:
                spool.save_cursor("siem", Cursor(1, offset))
            assert failure.value.errno == errno.ENOSPC
        assert temporaries(directory) == []
        assert spool.load_cursor("siem") == Cursor(1, 10)  # the last cursor that was saved


def test_a_full_disk_leaves_no_temporary_key_or_quota_file(full_disk: tuple[Path, Callable[[int], None]]) -> None:
    directory, fill = full_disk
    key_file = directory / "store.key"
    create_key_file(key_file, KeyFile(active=1, keys={1: new_key()}))
    backend = MemoryBackend(directory)
    fill(0)
    with pytest.raises(OSError):
        replace_key_file(key_file, read_key_file(key_file).with_key(2, new_key()))
    backend._quotas["q:ten_a"] = [5, time.time() + 3600]
    backend._dirty = True
    with pytest.raises(OSError):
        backend.persist()
    assert temporaries(directory) == []
    assert read_key_file(key_file).active == 1


def test_a_full_disk_leaves_no_torn_line_in_the_file_sink(full_disk: tuple[Path, Callable[[int], None]]) -> None:
    directory, fill = full_disk
    with Spool.open(SpoolSettings(directory / "spool", chain_id="gw-sink")) as spool:
        for n in range(6):
            spool.append(make_event(request_id=f"req-{n}", reasons=["x" * 200] * 15)).wait()
        records, _ = spool.read(Cursor(1, 0))
    sink = FileSink(directory / "audit.jsonl")
    sink.send(records[:1])
    fill(4096)  # room for one more record and a part of the next
    with pytest.raises(OSError):
        sink.send(records[1:4])
    (directory / "filler").unlink(missing_ok=True)
    sink.send(records[1:])  # the delivery's retry, once there is room again
    sink.close()
    report = verify_files([directory / "audit.jsonl"])
    assert report.ok, report.problem
    assert report.records == 6


def test_the_file_sink_cuts_a_torn_tail_a_killed_writer_left(tmp_path: Path) -> None:
    with Spool.open(SpoolSettings(tmp_path / "spool", chain_id="gw-torn")) as spool:
        for n in range(3):
            spool.append(make_event(request_id=f"req-{n}")).wait()
        records, _ = spool.read(Cursor(1, 0))
    path = tmp_path / "audit.jsonl"
    path.write_bytes(records[0].line + b"\n" + records[1].line[:50])  # killed in the middle of a batch
    sink = FileSink(path)
    sink.send(records[1:])  # delivered again after the restart (at least once)
    sink.close()
    report = verify_files([path])
    assert report.ok, report.problem
    assert report.records == 3


# -- restarts sweep what a killed writer left


def test_opening_sweeps_temporaries_a_killed_writer_left(tmp_path: Path) -> None:
    with Spool.open(SpoolSettings(tmp_path / "spool", chain_id="gw-sweep")) as spool:
        spool.save_cursor("siem", Cursor(1, 0))
    cursors = tmp_path / "spool" / "cursors"
    (cursors / ".siem.json.0123abcd.tmp").write_bytes(b"")
    (tmp_path / "spool" / ".chain.tmp").write_text("gw-half")  # the chain id's old temporary name
    (tmp_path / f".{STATE_FILE}.4242.tmp").write_text("{")  # the quota file's old temporary name
    (tmp_path / f".{STATE_FILE}.89abcdef0123.tmp").write_text("{")
    with Spool.open(SpoolSettings(tmp_path / "spool", chain_id="gw-sweep")) as spool:
        assert spool.load_cursor("siem") == Cursor(1, 0)
    MemoryBackend(tmp_path)
    assert temporaries(tmp_path) == []


# -- kill -9 at random points


def _check_files(directory: Path) -> None:
    key_file = read_key_file(directory / "store.key")
    assert key_file.active in key_file.keys
    report = verify_spool(directory / "spool")
    assert report.ok, report.problem
    for name in ("siem", "store"):
        cursor = json.loads((directory / "spool" / "cursors" / f"{name}.json").read_bytes())
        assert isinstance(cursor["segment"], int) and isinstance(cursor["offset"], int)
    quotas = json.loads((directory / "ratelimit" / STATE_FILE).read_text())
    assert quotas["version"] == 1


@pytest.mark.slow
def test_a_writer_killed_at_random_points_leaves_only_whole_files(tmp_path: Path) -> None:
    rng = random.Random(24)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), str(SUPPORT)])}
    directory = tmp_path / "files"
    directory.mkdir()
    started = time.monotonic()
    for kill in range(KILLS):
        writer = subprocess.Popen(
            [sys.executable, str(WRITER), str(directory)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        try:
            if kill == 0:  # the first run creates the files; the others find them
                assert writer.stdout is not None and writer.stdout.readline() == b"ready\n", writer.stderr
            time.sleep(rng.uniform(0.0, 0.15) if kill else 0.05)
        finally:
            writer.kill()
            writer.wait(timeout=10)
        assert writer.returncode == -9, writer.stderr.read() if writer.stderr else ""
        if kill:
            # Reopening is what a restarted gateway does: it sweeps the killed writer's temporaries.
            with Spool.open(SpoolSettings(directory / "spool", chain_id="gw-kill", segment_bytes=16 * 1024)):
                pass
            MemoryBackend(directory / "ratelimit")
            assert not [n for n in temporaries(directory) if not n.startswith(".store.key.")]
        _check_files(directory)
    assert time.monotonic() - started < 60
