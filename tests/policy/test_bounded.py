"""``policy.bounded.remember``: a dict that never holds more than its bound."""

from __future__ import annotations

from inferflux.policy.bounded import remember


def test_remember_keeps_values_and_empties_the_cache_at_its_bound() -> None:
    cache: dict[int, str] = {}
    assert remember(cache, 1, "a", 3) == "a" and cache == {1: "a"}
    remember(cache, 2, "b", 3)
    remember(cache, 3, "c", 3)
    assert len(cache) == 3
    remember(cache, 4, "d", 3)  # full: emptied, then the new entry
    assert cache == {4: "d"}
    remember(cache, 4, "e", 3)  # a known key is replaced, not added
    assert cache == {4: "e"}
