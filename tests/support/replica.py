"""``inferctl serve`` as a real process on a loopback port, for end-to-end tests; ``fleet`` starts several."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from servers import free_loopback_socket

import inferflux.kernels.cpu as kernels_cpu

START_TIMEOUT = 180.0


class Replica:
    """One ``inferctl serve`` process: ``wait_ready``, ``stop`` (SIGTERM), ``kill`` (SIGKILL), ``output``."""

    def __init__(
        self, name: str, data_dir: Path, env: dict[str, str], log: Path, extra_args: list[str] | None = None,
        port: int | None = None, program: list[str] | None = None,
    ) -> None:  # fmt: skip
        if port is None:
            sock = free_loopback_socket()
            port = sock.getsockname()[1]
            sock.close()
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.log = log
        argv = [
            *(program or [sys.executable, "-m", "inferflux.gateway.cli"]), "serve",
            "--port", str(self.port), "--data-dir", str(data_dir),
            "--dtype", "float32", "--kv-cache-bytes", "32MiB", "--log-level", "warning",
            *(extra_args or []),
        ]  # fmt: skip
        # A fresh checkout compiles the C++ kernels on their first load (a minute or more on two cores);
        # build them here, once per test process, so START_TIMEOUT times a start and not a compile.
        kernels_cpu.load()
        self._log_file = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self._terminated = False
        self.proc = subprocess.Popen(
            argv, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )

    def wait_ready(self, deadline: float | None = None) -> None:
        deadline = time.monotonic() + START_TIMEOUT if deadline is None else deadline
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not ready in {START_TIMEOUT} s:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")[-5000:]

    def kill(self) -> None:
        """SIGKILL: no shutdown work at all, as in a crash."""
        self.proc.kill()
        self.proc.wait(timeout=30)
        self._log_file.close()

    def terminate(self) -> None:
        """SIGTERM, once (a second one would cut the drain short)."""
        if self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self) -> int | None:
        """SIGTERM (if not sent yet), then wait for the exit; SIGKILL after 30 s. Returns the exit code."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log_file.close()
        return self.proc.returncode


@contextmanager
def fleet(count: int, env: dict[str, str], directory: Path, extra_args: list[str] | None = None) -> Iterator[list[Replica]]:
    """``count`` replicas ("replica 1", ...; data and log under ``directory``), started at once and all ready.

    They start together (their model loads overlap, and first-start work such as
    the bootstrap must cope with twins). At the end they are stopped together, and
    each must have exited cleanly with no traceback in its output.
    """
    replicas: list[Replica] = []
    try:
        for i in range(1, count + 1):
            replicas.append(Replica(f"replica {i}", directory / str(i), env, directory / f"{i}.log", extra_args))
        deadline = time.monotonic() + START_TIMEOUT
        for replica in replicas:
            replica.wait_ready(deadline)
        yield replicas
    finally:
        for replica in replicas:  # SIGTERM to all first: their drains run side by side
            replica.terminate()
        codes = [replica.stop() for replica in replicas]
        for replica, code in zip(replicas, codes, strict=True):
            assert "Traceback" not in replica.output(), replica.output()
            # uvicorn shuts down gracefully, then re-raises the signal it caught.
            assert code in (0, -signal.SIGTERM), f"{replica.name} exited with {code}:\n{replica.output()}"
