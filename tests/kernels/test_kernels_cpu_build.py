"""Where the CPU kernels build: one folder of torch's extension cache per copy of the sources."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from inferflux.kernels import cpu as cpu_kernels


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


def test_a_lock_left_by_a_killed_builder_is_removed_not_waited_on(tmp_path: Path) -> None:
    # The hang CI met: a builder killed inside torch's build leaves torch's lock file, and torch waits
    # for it to go away for ever. A builder that dies drops its flock with it, so the next one to take
    # the flock knows the torch lock has no owner.
    folder = tmp_path / "build"
    folder.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_BUILD, str(folder)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "building"
        assert (folder / cpu_kernels.TORCH_LOCK).exists()
        assert not _can_take_build_lock(folder)  # a live builder keeps others out
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert (folder / cpu_kernels.TORCH_LOCK).exists()  # left behind, as torch leaves it
    with cpu_kernels.building(folder):
        assert not (folder / cpu_kernels.TORCH_LOCK).exists()
        assert not _can_take_build_lock(folder)
    assert _can_take_build_lock(folder)


def test_the_build_runs_under_the_lock_with_no_stale_torch_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "1")
    folder = cpu_kernels.build_directory()
    (folder / cpu_kernels.TORCH_LOCK).touch()
    seen: dict[str, bool] = {}

    def load(**kwargs: object) -> ModuleType:
        seen["stale lock"] = (Path(str(kwargs["build_directory"])) / cpu_kernels.TORCH_LOCK).exists()
        seen["held"] = not _can_take_build_lock(folder)
        return ModuleType("built")

    monkeypatch.setattr(cpp_extension, "load", load)
    assert cpu_kernels._build().__name__ == "built"
    assert seen == {"stale lock": False, "held": True}


HOLD_THE_BUILD = """
import sys, time
from pathlib import Path
from inferflux.kernels import cpu
folder = Path(sys.argv[1])
with cpu.building(folder):
    (folder / cpu.TORCH_LOCK).touch()  # as torch's FileBaton does, then builds
    print("building", flush=True)
    time.sleep(600)
"""


def _can_take_build_lock(folder: Path) -> bool:
    with open(folder / cpu_kernels.BUILD_LOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True
