"""The libraries the suite takes as its oracles (transformers: the reference forward passes, tokenizers
and checkpoints), and the versions the tests were written against: the ones in constraints.txt,
which ``make test`` installs. An oracle's new release can change what it answers (5.x renamed
arguments and moved its GGUF code), so a test that skips for want of one, or fails beside one,
says which version it was written against and which is installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
from pathlib import Path
from types import ModuleType

import pytest

LOCK = Path(__file__).resolve().parents[2] / "constraints.txt"
ORACLES = ("transformers",)


def written_against(name: str) -> str:
    """The version of ``name`` in constraints.txt ("not locked" if the lock does not name it)."""
    wanted = re.sub(r"[-_.]+", "-", name).lower()
    for line in LOCK.read_text().splitlines():
        package, _, version = line.partition("==")
        if version and re.sub(r"[-_.]+", "-", package.strip()).lower() == wanted:
            return version.split(";")[0].strip()
    return "not locked"


def installed(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe(name: str) -> str:
    return f"{name} {installed(name)} is installed; these tests were written against {name} {written_against(name)} (constraints.txt)"


def require(name: str) -> ModuleType:
    """Import the oracle ``name``; without it skip (fail under CI), saying the version to install.

    Callable at a module's top level, like ``pytest.importorskip``."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        reason = f"{name} cannot be imported ({exc}); {describe(name)}"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI is set, so the tests against it must run")
        pytest.skip(reason, allow_module_level=True)


def used_by(item: pytest.Item) -> list[str]:
    """The oracles a test has imported: named in its module, or loaded by now at all when it uses
    one of the oracle fixtures (``ORACLE_FIXTURES`` in tests/conftest.py)."""
    module = getattr(item, "module", None)
    names = vars(module).values() if module is not None else ()
    return [name for name in ORACLES if any(getattr(value, "__name__", None) == name for value in names)]
