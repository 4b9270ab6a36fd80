"""Which endpoint gets a request: least outstanding requests, or a prefix's own endpoint.

Least-outstanding: among the endpoints that can take a request, the one with
the fewest in flight; ties go round the fleet, so a trickle of requests still
spreads. It follows the real cost of each endpoint (long generations hold a
slot longer) where round-robin would not.

Prefix affinity: requests that share a prompt prefix should meet the same
upstream's prefix cache. A consistent-hash ring (``VNODES`` points per
endpoint, blake2b, so every gateway replica computes the same ring) maps an
affinity key to an endpoint; an endpoint dropping out moves only its own keys.
Load is bounded (Mirrokni et al., "Consistent Hashing with Bounded Loads"):
an endpoint already at ``ceil(LOAD_FACTOR * average in-flight)`` is passed
over for the next one on the ring, so a hot prefix spills to a neighbour
instead of piling onto one endpoint.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

from inferflux.backends.openai.health import EndpointState

VNODES = 100  # ring points per endpoint: within a few percent of an even split of keys
LOAD_FACTOR = 1.25


def ring_hash(data: bytes) -> int:
    """A 64-bit hash, the same in every process (unlike ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class LeastOutstanding:
    """Picks the available endpoint with the fewest requests in flight."""

    def __init__(self, endpoints: Sequence[EndpointState]) -> None:
        self.endpoints = endpoints
        self._next = 0  # where the scan starts: ties rotate

    def pick(self, exclude: frozenset[int] = frozenset()) -> int | None:
        """The chosen endpoint's index, or None when none is available (``exclude``: tried already)."""
        count = len(self.endpoints)
        start = self._next
        self._next = (start + 1) % count
        best: int | None = None
        best_load = 0
        for offset in range(count):
            index = (start + offset) % count
            endpoint = self.endpoints[index]
            if index in exclude or not endpoint.available():
                continue
            if best is None or endpoint.inflight < best_load:
                best, best_load = index, endpoint.inflight
        return best


class PrefixRing:
    """Consistent hashing with bounded loads over a fleet's endpoints."""

    def __init__(self, endpoints: Sequence[EndpointState]) -> None:
        self.endpoints = endpoints
        points = sorted(
            (ring_hash(f"{endpoint.url}#{vnode}".encode()), index)
            for index, endpoint in enumerate(endpoints)
            for vnode in range(VNODES)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [index for _, index in points]

    def order(self, key: bytes) -> list[int]:
        """Every endpoint's index once, in the order the ring offers them to ``key``."""
        start = bisect.bisect(self._hashes, ring_hash(key))
        seen: list[int] = []
        size = len(self._owners)
        for step in range(size):
            owner = self._owners[(start + step) % size]
            if owner not in seen:
                seen.append(owner)
                if len(seen) == len(self.endpoints):
                    break
        return seen

    def pick(self, key: bytes, exclude: frozenset[int] = frozenset()) -> int | None:
        """``key``'s endpoint: the first available one on the ring under the load bound; None if none is available.

        The bound counts the request being placed: ``ceil(LOAD_FACTOR * (in
        flight + 1) / available endpoints)``. Some available endpoint is always
        under it, so a key is turned away only when nothing is available.
        """
        candidates = [i for i in self.order(key) if i not in exclude and self.endpoints[i].available()]
        if not candidates:
            return None
        total = sum(self.endpoints[i].inflight for i in candidates)
        bound = math.ceil(LOAD_FACTOR * (total + 1) / len(candidates))
        for index in candidates:
            if self.endpoints[index].inflight + 1 <= bound:
                return index
        return min(candidates, key=lambda i: self.endpoints[i].inflight)
