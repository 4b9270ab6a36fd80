"""A throwaway PostgreSQL cluster under a temporary directory, on a port of its own.

For outage tests: stopping it takes nothing away from the shared test server
that other tests use. Needs PostgreSQL's server binaries (``/usr/lib/postgresql/*/bin``);
initdb refuses to run as root, so as root the cluster belongs to the ``postgres`` user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from servers import free_loopback_socket


def server_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


class ThrowawayPostgres:
    """``start()`` / ``stop()`` as often as a test likes; ``remove()`` at the end. ``url`` (database postgres)."""

    def __init__(self) -> None:
        bindir = server_bin()
        if bindir is None:
            raise FileNotFoundError("no PostgreSQL server binaries under /usr/lib/postgresql")
        self._bin = bindir
        self._root = Path(tempfile.mkdtemp(prefix="inferflux-pg-"))
        self._data = self._root / "data"
        sock = free_loopback_socket()
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._user = None if os.geteuid() != 0 else pwd.getpwnam("postgres")
        if self._user is not None:
            os.chown(self._root, self._user.pw_uid, self._user.pw_gid)
        self._run("initdb", "-D", str(self._data), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")

    def _run(self, tool: str, *args: str) -> None:
        argv = [str(self._bin / tool), *args]
        if self._user is not None:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=self._root)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed: {done.stdout}{done.stderr}")

    def start(self) -> None:
        options = f"-p {self.port} -k {self._root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self._data), "-o", options, "-l", str(self._root / "log"), "-w", "start")

    def stop(self) -> None:
        """Fast shutdown: connections are cut, as in a crash of the database or a failover."""
        self._run("pg_ctl", "-D", str(self._data), "-m", "fast", "-w", "stop")

    def running(self) -> bool:
        return (self._data / "postmaster.pid").exists()

    def remove(self) -> None:
        try:
            if self.running():
                self.stop()
        finally:
            shutil.rmtree(self._root, ignore_errors=True)


def wait_until(predicate, timeout: float, step: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()
