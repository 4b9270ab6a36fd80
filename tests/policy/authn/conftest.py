"""Fixtures for authentication tests: a live loopback identity provider and a controllable clock."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from idp import EC_KID, ED_KID, RSA_KID, FakeClock, LoopbackIdP, running_idp


@pytest.fixture(scope="module")
def idp_server() -> Iterator[LoopbackIdP]:
    # One server (and one round of key generation) per module; ``idp`` resets it per test.
    with running_idp() as server:
        yield server


@pytest.fixture
def idp(idp_server: LoopbackIdP) -> LoopbackIdP:
    idp_server.reset(published=[RSA_KID, EC_KID, ED_KID])
    return idp_server


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
