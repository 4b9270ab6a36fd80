#!/usr/bin/env python3
"""Write tests/durations.json, the seconds each test file takes, from a run's JUnit XML.

``tests/support/longest_first.py`` hands the longest files to the workers
first; this is where it learns which are longest. Refresh it when files are
added or a file's time changes much:

    .venv/bin/python -m pytest -n auto --dist loadfile --junitxml=/tmp/junit.xml
    .venv/bin/python tests/support/record_durations.py /tmp/junit.xml

Times are summed per file (setup and teardown included, so a module fixture
that starts a server counts) and rounded to a tenth of a second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

from longest_first import RECORD  # the record its reader reads (this script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[2]


def file_of(classname: str) -> str | None:
    """The test file a JUnit classname (``tests.gateway.test_x`` or ``tests.gateway.test_x.TestY``) names."""
    parts = classname.split(".")
    while parts:
        candidate = Path(*parts).with_suffix(".py")
        if (ROOT / candidate).is_file():
            return candidate.as_posix()
        parts.pop()
    return None


def durations(junit: Path) -> tuple[dict[str, float], float]:
    files: dict[str, float] = {}
    times: list[float] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = file_of(case.get("classname", ""))
        if name is None:
            continue
        seconds = float(case.get("time", "0") or 0)
        files[name] = files.get(name, 0.0) + seconds
        times.append(seconds)
    if not files:
        raise SystemExit(f"{junit}: no test cases of this repository's files")
    return files, statistics.fmean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", type=Path, help="a JUnit XML report of a whole run (pytest --junitxml)")
    parser.add_argument("--out", type=Path, default=RECORD)
    args = parser.parse_args()
    files, per_test = durations(args.junit)
    record = {
        "about": "seconds per test file for tests/support/longest_first.py, by tests/support/record_durations.py",
        "seconds_per_test": round(per_test, 3),
        "files": {name: round(seconds, 1) for name, seconds in sorted(files.items(), key=lambda kv: -kv[1])},
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    total = sum(files.values())
    print(f"{args.out}: {len(files)} files, {total:.0f} s of tests, the longest {max(files.values()):.0f} s")


if __name__ == "__main__":
    main()
