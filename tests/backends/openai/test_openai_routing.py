"""Placement over a fleet's endpoints, without sockets: the ring, the load bound, least outstanding."""

from __future__ import annotations

import collections

from inferflux.backends.openai.health import EndpointState
from inferflux.backends.openai.routing import LeastOutstanding, PrefixRing


def endpoints(count: int, cap: int = 64) -> list[EndpointState]:
    return [EndpointState(f"http://10.0.0.{i}:8000/v1", cap=cap, breaker_failures=5, breaker_reset_seconds=10,
                          clock=lambda: 0.0) for i in range(count)]  # fmt: skip


KEYS = [f"tenant-{n % 7}:{n}".encode() for n in range(3000)]


def test_the_ring_spreads_keys_evenly_and_the_same_way_everywhere() -> None:
    ring, elsewhere = PrefixRing(endpoints(3)), PrefixRing(endpoints(3))  # another replica's ring
    owners = [ring.pick(key) for key in KEYS]
    assert owners == [elsewhere.pick(key) for key in KEYS]
    shares = collections.Counter(owners)
    assert all(700 <= shares[i] <= 1300 for i in range(3)), shares  # 1000 each, within 30 %


def test_an_endpoint_leaving_moves_only_its_own_keys() -> None:
    fleet = endpoints(4)
    ring = PrefixRing(fleet)
    before = {key: ring.pick(key) for key in KEYS}
    fleet[2].healthy = False
    after = {key: ring.pick(key) for key in KEYS}
    moved = [key for key in KEYS if before[key] != after[key]]
    assert moved and all(before[key] == 2 for key in moved)
    assert 2 not in after.values()
    fleet[2].healthy = True
    assert {key: ring.pick(key) for key in KEYS} == before


def test_the_load_bound_passes_a_full_owner_over() -> None:
    fleet = endpoints(2)
    ring = PrefixRing(fleet)
    key = KEYS[0]
    owner = ring.pick(key)
    assert owner is not None
    other = 1 - owner
    placed = []
    for _ in range(10):
        index = ring.pick(key)
        assert index is not None
        fleet[index].acquire()
        placed.append(index)
    # ceil(1.25 * 10 / 2) = 7 at most on the owner, and the owner first.
    assert placed[0] == owner and placed.count(owner) == 7 and placed.count(other) == 3
    # The neighbour is the next one on the ring, the same for the same key.
    assert ring.order(key) == [owner, other]


def test_nothing_available_is_none() -> None:
    fleet = endpoints(2, cap=1)
    ring, least = PrefixRing(fleet), LeastOutstanding(fleet)
    for endpoint in fleet:
        endpoint.acquire()
    assert ring.pick(KEYS[0]) is None and least.pick() is None


def test_least_outstanding_picks_the_emptiest_and_rotates_ties() -> None:
    fleet = endpoints(3)
    least = LeastOutstanding(fleet)
    fleet[0].inflight, fleet[1].inflight, fleet[2].inflight = 3, 1, 2
    assert [least.pick() for _ in range(3)] == [1, 1, 1]
    fleet[1].inflight = 2
    assert {least.pick() for _ in range(3)} == {1, 2}  # a turn round the fleet reaches both tied ones
    assert least.pick(exclude=frozenset({1, 2})) == 0


def test_a_breaker_moves_through_its_states() -> None:
    now = [0.0]
    endpoint = EndpointState("http://h/v1", cap=4, breaker_failures=2, breaker_reset_seconds=5, clock=lambda: now[0])
    endpoint.failed("HTTP 500")
    assert endpoint.circuit == "closed" and endpoint.available()
    endpoint.failed("HTTP 500")
    assert endpoint.circuit == "open" and not endpoint.available() and endpoint.half_opens_in() == 5
    now[0] = 5.0
    assert endpoint.circuit == "half_open" and endpoint.available()
    probe = endpoint.acquire()
    assert probe and not endpoint.available()  # one probe at a time
    endpoint.release(probe)
    endpoint.succeeded()
    assert endpoint.circuit == "closed" and endpoint.consecutive_failures == 0
    assert endpoint.status().failures == 2 and endpoint.status().last_error == "HTTP 500"
