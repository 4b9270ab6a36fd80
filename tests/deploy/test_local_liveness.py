"""deploy/local/run.py's check that a pid file still names the server it started (``is_ours``),
without starting servers: a child between fork and exec, a stranger, a dead pid."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import ROOT, load_script

run = load_script(ROOT / "deploy" / "local" / "run.py", "deploy_local_run")
pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc (Linux)")


def test_a_child_not_yet_exec_d_is_ours() -> None:
    # A server forked but not yet running `inferctl serve` still shows run.py's own command line
    # (a pid file read in that instant, by `up`'s "already running" check or by `status`).
    pid = os.fork()
    if pid == 0:  # the child: stay as the parent's image for a while, as between fork and exec
        time.sleep(2)
        os._exit(0)
    try:
        assert run.is_ours(pid, 18080)
    finally:
        os.waitpid(pid, 0)


def test_another_program_on_the_pid_is_not_ours() -> None:
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{stranger.pid}/cmdline").read_bytes() == Path("/proc/self/cmdline").read_bytes():
            if time.monotonic() > deadline:
                pytest.fail("the child never exec'd")
            time.sleep(0.01)  # until it runs its own program
        assert not run.is_ours(stranger.pid, 18080)
    finally:
        stranger.kill()
        stranger.wait()


def test_a_pid_that_exited_is_not_ours() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert not run.is_ours(done.pid, 18080)


def test_wait_ready_reports_a_server_that_exited_with_its_status_and_log(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "gateway-1.log").write_text("boom: the config is wrong\n")
    failed = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    failed.wait()
    with pytest.raises(run.LocalError, match=r"gateway-1 exited during start-up \(status 3\)(.|\n)*config is wrong"):
        run.wait_ready(tmp_path, {"gateway-1": (failed, 1)}, timeout=5)


def test_wait_ready_takes_a_server_just_started_for_a_starting_one(tmp_path: Path) -> None:
    # Checked the instant after it is spawned (what failed in CI): alive, not ready, so the wait
    # runs out on readiness, not on "exited".
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "gateway-3.log").write_text("")
    starting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(run.LocalError, match="not ready after"):
            run.wait_ready(tmp_path, {"gateway-3": (starting, 1)}, timeout=1)
    finally:
        starting.kill()
        starting.wait()
