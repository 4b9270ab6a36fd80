"""Audit fixtures: spools, loopback HTTP receivers and a real rsyslogd (helpers in ``audit_support``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from audit_support import HttpReceiver, Rsyslog, make_test_ca, rsyslogd_path

from inferflux.policy.audit.spool import Spool, SpoolSettings


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def spool(spool_dir: Path) -> Iterator[Spool]:
    with Spool.open(SpoolSettings(spool_dir, chain_id="gw-test")) as opened:
        yield opened


@pytest.fixture
def http_receiver() -> Iterator[Callable[..., HttpReceiver]]:
    made: list[HttpReceiver] = []

    def make(**kwargs: Any) -> HttpReceiver:
        receiver = HttpReceiver(**kwargs)
        made.append(receiver)
        return receiver

    yield make
    for receiver in made:
        receiver.stop()


@pytest.fixture
def rsyslog(tmp_path: Path) -> Iterator[Rsyslog]:
    """A running rsyslogd with UDP, TCP and TLS inputs (``make_test_ca``'s CA is at tmp_path/tls/ca.pem)."""
    binary = rsyslogd_path()
    tls_dir = tmp_path / "tls"
    tls_dir.mkdir()
    work = tmp_path / "rsyslog"
    work.mkdir()
    server = Rsyslog(binary, work, make_test_ca(tls_dir)).start()
    yield server
    server.stop()
