"""Guardrail test fixtures: compiled guardrails from a spec, and a loopback OPA-compatible server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opa_server import LoopbackOpa, running_opa

from inferflux.policy.guardrails import Guardrails, parse_spec



@pytest.fixture
def make_guardrails() -> Callable[..., Guardrails]:
    """``make_guardrails(spec_dict, sensitive=None, name="p")``: the compiled guardrails of one policy."""

    def make(spec: dict[str, Any], sensitive: str | None = None, name: str = "p") -> Guardrails:
        return Guardrails([parse_spec(spec, sensitive, name=name)])

    return make


@pytest.fixture(scope="module")
def opa_server() -> Iterator[LoopbackOpa]:
    with running_opa() as server:
        yield server


@pytest.fixture
def opa(opa_server: LoopbackOpa) -> LoopbackOpa:
    opa_server.modules.clear()
    opa_server.delay = 0.0
    opa_server.token = None
    opa_server.requests.clear()
    return opa_server
