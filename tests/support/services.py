"""Tests that need a service on loopback (PostgreSQL, Redis, rsyslog, ...).

When the service is down its tests are skipped with the reason, except under
CI (``$CI`` set), where that is a failure: CI starts the services, so a
skip there would hide a broken set-up.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def service_unavailable(reason: str, what: str) -> NoReturn:
    """Skip (or, under CI, fail) the test that needs ``what``, saying ``reason``."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI is set, so the {what} tests must run")
    pytest.skip(reason)
