"""deploy/local/run.py's check that a pid file still names the server it started (``is_ours``),
without starting servers: a child between fork and exec, a stranger, a dead pid."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.scripts import ROOT, load_script

run = load_script(ROOT / "deploy" / "local" / "run.py", "deploy_local_run")
pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc (Linux)")


def test_a_child_not_yet_exec_d_is_ours() -> None:
    # What run.py's wait_ready saw in CI: gateway-3 forked but not yet running `inferctl serve`,
    # so its command line was still run.py's own, and it was taken for a gateway that had exited.
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
