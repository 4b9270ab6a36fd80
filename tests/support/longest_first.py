"""A pytest plugin: under pytest-xdist, test files go to the workers longest first.

``make test`` hands out a file at a time (``--dist loadfile``). xdist's own
order is by the number of tests in a file, so the files of one long test (the
kill -9 audit test and the soak: up to a minute each on a slow host) came
last, and the other worker sat idle while they ran. Handing out the longest
first (the classic longest-processing-time rule) leaves only short files for
the end, so the two workers finish within seconds of each other.

How long a file takes is read from ``tests/durations.json`` (seconds per file,
setup and teardown included; ``$INFERFLUX_TEST_DURATIONS`` names another),
which ``tests/support/record_durations.py`` writes from a run's JUnit XML. A
file the record does not know is weighed as its number of tests times the
record's mean seconds per test. A stale record only costs time, never a
result: the order of files changes, the order of tests inside a file does
not. Without xdist nothing is reordered.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

RECORD = Path(__file__).resolve().parent.parent / "durations.json"


def read_record(path: Path | None = None) -> tuple[dict[str, float], float]:
    """The record's seconds per file and its mean seconds per test (1 s if it is missing or unreadable)."""
    path = path or Path(os.environ.get("INFERFLUX_TEST_DURATIONS", RECORD))
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, 1.0
    files = {str(name): float(seconds) for name, seconds in data.get("files", {}).items()}
    return files, float(data.get("seconds_per_test", 1.0))


def longest_first(items: list[pytest.Item], files: dict[str, float], per_test: float) -> list[pytest.Item]:
    """``items`` with whole files in descending order of their expected time; each file's own order kept."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    weight = {name: files.get(name, per_test * len(tests)) for name, tests in by_file.items()}
    ordered = sorted(by_file, key=lambda name: -weight[name])  # stable: equal weights keep collection order
    return [item for name in ordered for item in by_file[name]]


def pytest_configure(config: pytest.Config) -> None:
    # The controller would otherwise re-sort the files by their number of tests.
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Every worker sorts its collection the same way (xdist checks they agree); the controller
    # hands the files out in that order.
    if hasattr(config, "workerinput"):
        items[:] = longest_first(items, *read_record())
