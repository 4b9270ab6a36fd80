"""Every script in benchmarks/ starts as its docstring says to run it (``.venv/bin/python benchmarks/NAME.py``):
its imports resolve with only the installed package and its own folder on sys.path (never the checkout's
root), and ``--help`` answers. bench_serving.py imported ``benchmarks.serving_extras`` once the root left
sys.path, and nothing noticed until a run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py")
SCRIPTS = [p for p in FILES if 'if __name__ == "__main__":' in p.read_text()]
MODULES = [p for p in FILES if p not in SCRIPTS]  # what the scripts import from their folder


@pytest.mark.slow  # each starts a Python that imports torch or the gateway: a few seconds apiece
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_answers_help_as_a_user_runs_it(script: Path, tmp_path: Path) -> None:
    # From another folder, so that nothing resolves through the working directory either.
    done = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower(), done.stdout[:500]


@pytest.mark.slow
@pytest.mark.parametrize("module", MODULES, ids=lambda p: p.name)
def test_a_module_the_scripts_share_imports_from_their_folder(module: Path, tmp_path: Path) -> None:
    code = f"import sys; sys.path.insert(0, {str(module.parent)!r}); import {module.stem}"
    done = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
