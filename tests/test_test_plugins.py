"""The suite's own pytest plugins (tests/support) do their job under pytest-xdist, as `make test` runs them.

Each test runs a small suite of its own in a fresh pytest process (with two workers, and one process
where that is the comparison).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "tests" / "support"

pytestmark = pytest.mark.slow  # pytest processes of their own, with worker processes


def run_suite(directory: Path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    (directory / "test_inner.py").write_text(textwrap.dedent(source))
    (directory / "pytest.ini").write_text("[pytest]\nmarkers =\n    serial: runs alone\n")
    return run_pytest(directory, *args)


def run_pytest(directory: Path, *args: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    """A fresh pytest over ``directory``, with the suite's plugins importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), str(REPO)]), **env_vars}
    env.pop("PYTEST_XDIST_WORKER", None)  # this suite may itself run in a worker
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(directory)]
    return subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=120)


SPANS = """
    import json, time
    from pathlib import Path

    import pytest

    def span(name):
        start = time.monotonic()
        time.sleep(0.4)
        line = json.dumps({"name": name, "start": start, "end": time.monotonic()})
        with open(Path(__file__).with_name("spans.jsonl"), "a") as out:
            out.write(line + "\\n")

    @pytest.mark.parametrize("i", range(6))
    def test_shared(i):
        span(f"shared{i}")

    @pytest.mark.serial
    @pytest.mark.parametrize("i", range(2))
    def test_alone(i):
        span(f"alone{i}")
"""


def spans(directory: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (directory / "spans.jsonl").read_text().splitlines()]


def overlaps(a: dict[str, float], b: dict[str, float]) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_serial_tests_run_alone_while_the_others_run_side_by_side(tmp_path: Path) -> None:
    result = run_suite(tmp_path, SPANS, "-p", "serial_lock", "-n", "2", "--dist", "load")
    assert result.returncode == 0, result.stdout + result.stderr
    seen = spans(tmp_path)
    assert len(seen) == 8
    alone = [s for s in seen if str(s["name"]).startswith("alone")]
    shared = [s for s in seen if str(s["name"]).startswith("shared")]
    for serial in alone:
        assert not any(overlaps(serial, other) for other in seen if other is not serial), (serial, seen)
    # ...and without the serial tests the workers did overlap: the lock does not serialise everything.
    assert any(overlaps(a, b) for a in shared for b in shared if a is not b), seen


def test_without_the_plugin_the_same_suite_overlaps_its_serial_tests(tmp_path: Path) -> None:
    # The check above can fail: two workers with nothing to stop them run a serial test beside another.
    result = run_suite(tmp_path, SPANS.replace("time.sleep(0.4)", "time.sleep(1.0)"), "-n", "2", "--dist", "load")
    assert result.returncode == 0, result.stdout + result.stderr
    seen = spans(tmp_path)
    alone = [s for s in seen if str(s["name"]).startswith("alone")]
    assert any(overlaps(serial, other) for serial in alone for other in seen if other is not serial), seen


def test_a_secret_in_a_log_record_fails_the_run_from_a_worker(tmp_path: Path) -> None:
    leaky = """
        import logging

        from secret_watch import remember

        def test_clean():
            logging.getLogger("app").warning("nothing to see")

        def test_leaky():
            logging.getLogger("app").warning("client secret is %s", remember("hunter2-client-secret"))
    """
    for workers in ("0", "2"):
        result = run_suite(tmp_path, leaky, "-p", "secret_watch", "-n", workers)
        output = result.stdout + result.stderr
        assert result.returncode == 1, output
        assert "test_leaky" in output and "secrets in log records" in output, output
        assert "1 failed" not in output and "1 error" in output  # the test ran; its teardown reports the leak


def test_files_go_to_the_workers_longest_first(tmp_path: Path) -> None:
    # Three files whose numbers of tests (xdist's own order: most first) disagree with the record.
    counts = {"test_few.py": 1, "test_mid.py": 3, "test_many.py": 5}
    for name, count in counts.items():
        (tmp_path / name).write_text(textwrap.dedent(f"""
            import pytest
            from pathlib import Path

            @pytest.mark.parametrize("i", range({count}))
            def test_it(i):
                with open(Path(__file__).with_name("order.txt"), "a") as out:
                    out.write("{name}\\n")
        """))
    record = tmp_path / "durations.json"
    record.write_text(json.dumps({"seconds_per_test": 1.0, "files": {"test_few.py": 100.0, "test_mid.py": 50.0}}))

    def order(*plugin: str) -> list[str]:
        (tmp_path / "order.txt").unlink(missing_ok=True)
        result = run_pytest(tmp_path, *plugin, "-n", "1", "--dist", "loadfile", INFERFLUX_TEST_DURATIONS=str(record))
        assert result.returncode == 0, result.stdout + result.stderr
        return list(dict.fromkeys((tmp_path / "order.txt").read_text().split()))

    # test_many.py is not in the record: 5 tests at its mean of 1 s a test weigh 5 s, the least.
    assert order("-p", "longest_first") == ["test_few.py", "test_mid.py", "test_many.py"]
    assert order() == ["test_many.py", "test_mid.py", "test_few.py"]  # the check above can fail
