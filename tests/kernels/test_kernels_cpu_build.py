"""Where the CPU kernels build: one folder of torch's extension cache per copy of the sources."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels import cpu as cpu_kernels


def test_each_copy_of_the_sources_builds_in_a_folder_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two checkouts sharing one folder rebuilt over each other, and a builder killed midway left a lock
    # that every later load waited on: each source folder gets its own, the same one every time.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    here = cpu_kernels.build_directory()
    assert here == cpu_kernels.build_directory() and here.is_dir()
    assert here.parent == tmp_path / "cache" and here.name.startswith(f"{cpu_kernels.EXTENSION}-")
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", tmp_path / "another-checkout" / "kernels" / "cpu")
    elsewhere = cpu_kernels.build_directory()
    assert elsewhere != here and elsewhere.parent == here.parent and elsewhere.is_dir()
