"""The egress rules (``backends/openai/egress.py``): which hosts a fleet may be configured with, and which
addresses it may connect to once a name is resolved, over real sockets to the fake upstream."""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.abc import AbstractResolver, ResolveResult
from fake_upstream import FakeUpstream, running_fake_upstream

from inferflux.backends.openai.egress import EgressPolicy, EgressRefused, address_kind
from inferflux.backends.openai.errors import UpstreamUnavailable
from inferflux.backends.openai.fleet import Fleet, FleetConfig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True, "max_tokens": 2}


@pytest.mark.parametrize(("address", "kind"), [
    ("169.254.169.254", "forbidden"), ("169.254.10.10", "forbidden"), ("fd00:ec2::254", "forbidden"),
    ("100.100.100.200", "forbidden"), ("fe80::1", "forbidden"), ("::ffff:169.254.169.254", "forbidden"),
    ("64:ff9b::a9fe:a9fe", "forbidden"), ("2002:a9fe:a9fe::1", "forbidden"), ("0.0.0.0", "forbidden"),
    ("::", "forbidden"), ("224.0.0.1", "forbidden"), ("255.255.255.255", "forbidden"),
    ("127.0.0.1", "private"), ("::1", "private"), ("10.1.2.3", "private"), ("172.16.0.1", "private"),
    ("192.168.1.1", "private"), ("fd12:3456::1", "private"), ("100.64.0.1", "private"), ("::ffff:10.0.0.1", "private"),
    ("8.8.8.8", "public"), ("2606:4700::1111", "public"),
])  # fmt: skip
def test_every_address_has_its_kind(address: str, kind: str) -> None:
    assert address_kind(ipaddress.ip_address(address)) == kind


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest", "http://[fd00:ec2::254]/v1", "http://metadata.google.internal/v1",
    "http://METADATA.google.internal./v1", "http://[fe80::1]:8000/v1", "http://10.0.0.5:8000/v1",
    "http://192.168.0.10/v1", "http://127.0.0.1:8000/v1", "http://localhost:8000/v1", "http://api.localhost/v1",
    "http://[::1]:8000/v1", "http://[fd12::1]/v1", "http://[::ffff:127.0.0.1]/v1", "http://0.0.0.0:8000/v1",
])  # fmt: skip
def test_without_an_allow_list_only_public_hosts_are_configured(url: str) -> None:
    with pytest.raises(ValueError, match=r"endpoints\[0\]: the upstream host"):
        FleetConfig(endpoints=(url,))
    FleetConfig(endpoints=("https://api.example.com/v1", "http://8.8.8.8:8000/v1"))


def test_an_allow_list_names_hosts_and_ranges_but_never_unlocks_metadata_by_range() -> None:
    policy = EgressPolicy(allowed_hosts=("*.fleet.internal", "10.0.0.0/8", "127.0.0.1", "169.254.0.0/16"))
    for url in ("http://gpu-1.fleet.internal/v1", "http://10.9.8.7/v1", "http://127.0.0.1:9/v1"):
        FleetConfig(endpoints=(url,), egress=policy)
    for url in ("http://fleet.internal/v1", "http://api.example.com/v1", "http://192.168.1.1/v1",
                "http://169.254.169.254/v1", "http://169.254.1.1/v1"):  # fmt: skip
        with pytest.raises(ValueError, match="upstreams.allowed_hosts"):
            FleetConfig(endpoints=(url,), egress=policy)
    FleetConfig(endpoints=("http://169.254.169.254/v1",), egress=EgressPolicy(allowed_hosts=("169.254.169.254",)))


def test_the_gateways_own_port_is_refused_whatever_the_allow_list() -> None:
    policy = EgressPolicy(allowed_hosts=("127.0.0.1", "localhost", "10.0.0.7"), own_port=8080,
                          own_addresses=frozenset({ipaddress.ip_address("10.0.0.7")}))  # fmt: skip
    for url in ("http://127.0.0.1:8080/v1", "http://localhost:8080/v1", "http://10.0.0.7:8080/v1"):
        with pytest.raises(ValueError, match="own address and port 8080"):
            FleetConfig(endpoints=(url,), egress=policy)
    FleetConfig(endpoints=("http://127.0.0.1:8081/v1", "http://10.0.0.7:8000/v1"), egress=policy)


def test_allow_list_entries_are_checked() -> None:
    for entry in ("", "http://x", "a b", "10.0.0.0/33", "*.", "x..y"):
        with pytest.raises(ValueError):
            EgressPolicy(allowed_hosts=(entry,))


# -- at connect time ---------------------------------------------------------------------------------------------


class Stub(AbstractResolver):
    """Answers every lookup of ``name`` with ``addresses``, as an attacker's DNS server would (rebinding a name
    that looked public to loopback, say); the connection itself is real."""

    def __init__(self, name: str, addresses: list[str]) -> None:
        self.name, self.addresses, self.asked = name, addresses, 0

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:  # fmt: skip
        assert host == self.name
        self.asked += 1
        return [{"hostname": host, "host": a, "port": port, "family": socket.AF_INET6 if ":" in a else socket.AF_INET,
                 "proto": 0, "flags": socket.AI_NUMERICHOST} for a in self.addresses]  # fmt: skip

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeUpstream]:
    with running_fake_upstream("egress") as served:
        yield served


async def stream_through(fake: FakeUpstream, name: str, addresses: list[str], egress: EgressPolicy) -> Any:
    """A chat streamed to ``http://name:<fake's port>/v1`` with ``name`` resolving to ``addresses``."""
    port = int(fake.url.split(":")[2].split("/")[0])
    resolver = Stub(name, addresses)
    fleet = Fleet(FleetConfig(endpoints=(f"http://{name}:{port}/v1",), health_interval_seconds=0, retries=0,
                              connect_timeout_seconds=2, egress=egress), resolver=resolver)  # fmt: skip
    try:
        return [chunk async for chunk in fleet.stream("/chat/completions", CHAT)]
    finally:
        await fleet.aclose()
        assert resolver.asked, "the name was never looked up"


async def test_a_name_allowed_by_name_reaches_what_it_resolves_to(fake: FakeUpstream) -> None:
    """The control: the stub really routes the name to the fake upstream."""
    fake.reset_counters()
    chunks = await stream_through(fake, "gpu-1.fleet.internal", ["127.0.0.1"],
                                  EgressPolicy(allowed_hosts=("*.fleet.internal",)))  # fmt: skip
    assert chunks and fake.requests["chat"] == 1


@pytest.mark.parametrize(("name", "addresses", "allowed", "rule"), [
    # a name that passed as public, resolving (rebinding) to loopback: private, not allowed
    ("rebind.example.com", ["127.0.0.1"], None, "private address (127.0.0.1)"),
    # one refused address among several refuses the name
    ("rebind.example.com", ["93.184.216.34", "127.0.0.1"], None, "private address (127.0.0.1)"),
    ("rebind.example.com", ["::ffff:127.0.0.1"], None, "private address (127.0.0.1)"),
    # a named host resolving to a metadata address: only that address itself in the list would do
    ("gpu-1.fleet.internal", ["169.254.169.254"], ("*.fleet.internal", "169.254.0.0/16"), "metadata"),
    # or to a link-local one
    ("gpu-1.fleet.internal", ["10.0.0.5", "fe80::1"], ("*.fleet.internal",), "link-local"),
])  # fmt: skip
async def test_a_name_resolving_to_a_refused_address_is_refused_at_connect(
    fake: FakeUpstream, caplog: pytest.LogCaptureFixture, name: str, addresses: list[str],
    allowed: tuple[str, ...] | None, rule: str,
) -> None:
    fake.reset_counters()
    caplog.set_level(logging.WARNING, logger="inferflux.backends.openai.transport")
    with pytest.raises(UpstreamUnavailable):
        await stream_through(fake, name, addresses, EgressPolicy(allowed_hosts=allowed))
    assert fake.requests["chat"] == 0  # nothing reached the address, though it listens there
    refusals = [r.getMessage() for r in caplog.records if "egress rules" in r.getMessage()]
    assert refusals and rule in refusals[0], refusals


async def test_the_gateways_own_port_is_refused_at_connect(fake: FakeUpstream) -> None:
    port = int(fake.url.split(":")[2].split("/")[0])
    fake.reset_counters()
    with pytest.raises(UpstreamUnavailable):
        await stream_through(fake, "self.fleet.internal", ["127.0.0.1"],
                             EgressPolicy(allowed_hosts=("*.fleet.internal",), own_port=port))  # fmt: skip
    assert fake.requests["chat"] == 0


def test_a_refusal_is_an_oserror_naming_the_host_not_the_url() -> None:
    with pytest.raises(EgressRefused) as caught:
        EgressPolicy().check_endpoint("http://169.254.169.254:80/latest/meta-data")
    assert isinstance(caught.value, OSError) and "meta-data" not in str(caught.value)
