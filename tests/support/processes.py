"""A process's state read from /proc (Linux): whether it runs, and the CPU time it used."""

from __future__ import annotations

import os


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command's ")" (field 3, the state, first); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return None


def alive(pid: int) -> bool:
    """Running or sleeping: neither gone nor a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[0] != b"Z"


def cpu_seconds(pid: int) -> float:
    """User and system CPU time so far (0 once it is gone)."""
    fields = _stat(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
