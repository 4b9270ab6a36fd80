"""A pytest plugin: tests marked ``serial`` run alone, also when pytest-xdist spreads the suite.

``make test`` runs the suite in one worker process per core (pytest-xdist):
most tests wait on sockets, subprocesses and clocks as much as they compute,
so on two cores two workers finish it in well under the time one takes. A few
tests assert a time under load (how fast a revocation reaches a replica, a
shared limit's accuracy over a real window, a close timed against a deadline,
the share of a request's wall time its traced stages cover):
beside another worker's tests they would measure the neighbour instead. Those
carry ``@pytest.mark.serial``.

Each test runs holding a shared lock on a file all workers of the run open (in
the run's temporary folder, the parent of each worker's ``--basetemp``); a
``serial`` test holds it exclusively, so it starts once the tests running in
the other workers have ended, and no other test starts until it has ended. A
second file is the turnstile every test passes before asking for the first,
so a waiting ``serial`` test is not starved by workers taking turns with the
shared lock. A test's module fixtures are set up inside its ``setup`` phase,
so a server a ``serial`` test's module starts starts alone too. Without xdist
there is one process and nothing is locked.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

_files: tuple[IO[bytes], IO[bytes]] | None = None  # (turnstile, run) of this worker, under xdist


def pytest_configure(config: pytest.Config) -> None:
    global _files
    if not hasattr(config, "workerinput"):  # not an xdist worker
        return
    run_folder = Path(config.option.basetemp).parent  # xdist gives each worker <the run's folder>/<worker id>
    _files = (open(run_folder / "serial.turnstile", "ab"), open(run_folder / "serial.run", "ab"))  # noqa: SIM115


def pytest_unconfigure(config: pytest.Config) -> None:
    global _files
    if _files is not None:
        for file in _files:
            file.close()
        _files = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if _files is None:
        return (yield)
    turnstile, run = _files
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    try:
        fcntl.flock(run, fcntl.LOCK_EX if item.get_closest_marker("serial") else fcntl.LOCK_SH)
    finally:
        fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
        return (yield)
    finally:
        fcntl.flock(run, fcntl.LOCK_UN)
