"""A script of the repository (a benchmark, deploy/local/run.py) imported as a module, for tests
of its pure parts; those folders are not packages."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(path: Path, name: str) -> ModuleType:
    """The script at ``path`` as a module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module."""
    return load_script(ROOT / "benchmarks" / f"{name}.py", name)
