"""The backend registry: discovery, probes, the priority chain, the allow-list, and
a third-party backend installed as a distribution of its own.

The third-party backend is real: a package plus a hand-written ``*.dist-info``
(METADATA, entry_points.txt) on a temporary sys.path entry, exactly what pip
leaves in site-packages. Its class is the CPU backend under another name, so
choosing it serves the model. Importing its module appends to a marker file, so
a test can tell whether the registry ever imported it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from inferflux.backends import registry
from inferflux.backends.base import BackendError

ACME_MODULE = "acme_inferflux_backend"
ACME_CODE = '''
import os

from inferflux.backends.cpu import CPUBackend

if os.environ.get("ACME_IMPORT_MARKER"):
    with open(os.environ["ACME_IMPORT_MARKER"], "a") as f:
        f.write("imported\\n")


class AcmeBackend(CPUBackend):
    name = "acme"

    @classmethod
    def probe(cls):
        return os.environ.get("ACME_UNAVAILABLE") or super().probe()


class RaisingProbe(AcmeBackend):
    @classmethod
    def probe(cls):
        raise RuntimeError("the driver crashed")
'''


def write_distribution(site: Path, name: str, version: str, entry_points: dict[str, str]) -> None:
    """A ``name-version.dist-info`` with METADATA and entry_points.txt, as an installer writes it."""
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    (dist_info / "entry_points.txt").write_text(f"[{registry.GROUP}]\n{lines}")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (registry.ALLOWED_ENV, registry.PRIORITY_ENV, "ACME_UNAVAILABLE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def acme_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The 'acme-inferflux' distribution on sys.path; its import marker at ``<site>/../imported``."""
    site = tmp_path / "site"
    (site / ACME_MODULE).mkdir(parents=True)
    (site / ACME_MODULE / "__init__.py").write_text(ACME_CODE)
    write_distribution(site, "acme-inferflux", "1.0", {"acme": f"{ACME_MODULE}:AcmeBackend"})
    monkeypatch.setenv("ACME_IMPORT_MARKER", str(tmp_path / "imported"))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, ACME_MODULE, raising=False)  # restored (dropped) afterwards
    return site


def imported(site: Path) -> bool:
    return (site.parent / "imported").exists()


# -- the built-in backends ---------------------------------------------------------------------


def test_builtin_backends_are_discovered_with_a_reason_for_each_unavailable_one() -> None:
    statuses = {s.name: s for s in registry.statuses()}
    assert {"cpu", "cuda", "metal", "mlx"} <= set(statuses)
    for status in statuses.values():
        assert status.allowed
        assert (status.reason is None) == status.available, status
        assert status.provider and status.provider.startswith("inferflux "), status
    assert statuses["cpu"].available
    if platform.system() != "Darwin":
        assert not statuses["metal"].available and "macOS" in str(statuses["metal"].reason)


def test_default_chain_puts_fast_accelerators_first_and_cpu_before_mlx_on_linux() -> None:
    linux, mac = registry.default_priority("Linux"), registry.default_priority("Darwin")
    assert linux[:2] == mac[:2] == ("cuda", "metal")
    assert linux.index("cpu") < linux.index("mlx")  # mlx on Linux is a slow reference-BLAS build
    assert mac.index("mlx") < mac.index("cpu")  # on Apple silicon mlx runs on the GPU
    assert registry.configured_priority() == registry.default_priority()


def test_auto_is_the_cpu_backend_here_without_configuration() -> None:
    cuda = registry.probe("cuda")
    if cuda.available or platform.system() == "Darwin":
        pytest.skip(f"this machine has an accelerator backend that comes before cpu (cuda: {cuda.reason})")
    assert registry.resolve("auto")[0] == "cpu"
    assert registry.probe("auto") == registry.BackendStatus("auto", True, None, True, *_origin("cpu"))


def _origin(name: str) -> tuple[str | None, str | None]:
    status = registry.probe(name)
    return status.provider, status.target


def test_priority_from_the_environment_and_its_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.PRIORITY_ENV, " nothing-here , cpu ,")
    assert registry.configured_priority() == ("nothing-here", "cpu")
    assert registry.resolve("auto")[0] == "cpu"  # an uninstalled name is skipped
    assert registry.configured_priority(["mlx"]) == ("mlx",)  # the settings' chain wins over the env
    for bad, message in (("cpu,auto", "'auto' is not a backend name"), ("cpu,cpu", "listed twice")):
        monkeypatch.setenv(registry.PRIORITY_ENV, bad)
        with pytest.raises(BackendError, match=message):
            registry.configured_priority()


def test_unknown_and_unavailable_explicit_names_are_errors(acme_site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BackendError, match=r"unknown backend 'no-such'.*installed: .*acme.*cpu"):
        registry.resolve("no-such")
    monkeypatch.setenv("ACME_UNAVAILABLE", "no acme card in this machine")
    # Named explicitly: the reason, never a quiet fallback to another backend.
    with pytest.raises(BackendError, match="backend 'acme' cannot be used here: no acme card in this machine"):
        registry.resolve("acme")
    # Through the chain it is skipped, and when nothing is left the error lists every reason.
    assert registry.resolve("auto", priority=["acme", "cpu"])[0] == "cpu"
    with pytest.raises(BackendError, match=r"priority chain \(acme, gone\).*acme: no acme card.*gone: not installed"):
        registry.resolve("auto", priority=["acme", "gone"])


# -- a third-party distribution --------------------------------------------------------------------


def test_a_third_party_distribution_is_discovered_probed_and_chosen_when_first(acme_site: Path) -> None:
    from inferflux.backends.cpu import CPUBackend

    assert "acme" in registry.backend_names()
    status = registry.probe("acme")
    assert status == registry.BackendStatus(
        "acme", True, None, True, provider="acme-inferflux 1.0", target=f"{ACME_MODULE}:AcmeBackend"
    )
    name, cls = registry.resolve("auto", priority=["acme", "cpu"])
    assert name == "acme" and cls.__module__ == ACME_MODULE and issubclass(cls, CPUBackend)
    # Not in the chain: installed is not enough for auto to pick it.
    assert registry.resolve("auto", priority=["cpu"])[0] == "cpu"


def test_the_allow_list_blocks_a_backend_without_importing_it(
    acme_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(registry.ALLOWED_ENV, "cpu, mlx")
    status = registry.probe("acme")
    assert not status.available and not status.allowed
    assert status.reason == f"not allowed by {registry.ALLOWED_ENV} (allowed: cpu, mlx)"
    assert status.provider == "acme-inferflux 1.0"  # from the metadata alone
    listed = {s.name: s for s in registry.statuses(priority=["acme", "cpu"])}
    assert not listed["acme"].allowed and not listed["cuda"].allowed and listed["cpu"].available
    with pytest.raises(BackendError, match="not allowed by INFERFLUX_BACKENDS_ALLOWED"):
        registry.resolve("acme")
    assert registry.resolve("auto", priority=["acme", "cpu"])[0] == "cpu"
    assert not imported(acme_site) and ACME_MODULE not in sys.modules
    monkeypatch.setenv(registry.ALLOWED_ENV, "acme")
    assert registry.probe("acme").available and imported(acme_site)


def test_two_distributions_claiming_one_name_load_neither(acme_site: Path) -> None:
    write_distribution(acme_site, "other-vendor", "2.0", {"acme": "other_vendor_module:Backend"})
    status = registry.probe("acme")
    assert not status.available
    assert "more than one distribution" in str(status.reason)
    assert "acme-inferflux 1.0" in str(status.reason) and "other-vendor 2.0" in str(status.reason)
    with pytest.raises(BackendError, match="more than one distribution"):
        registry.resolve("acme")
    assert not imported(acme_site)


def test_broken_plugins_are_reported_not_raised(acme_site: Path) -> None:
    write_distribution(acme_site, "broken-vendor", "0.1", {
        "missing-module": "no_such_module_anywhere:Backend",
        "crashing-probe": f"{ACME_MODULE}:RaisingProbe",
        "not-a-class": "os:sep",
    })
    statuses = {s.name: s for s in registry.statuses()}
    assert "failed to import no_such_module_anywhere:Backend: ModuleNotFoundError" in str(
        statuses["missing-module"].reason)
    assert statuses["crashing-probe"].reason == "probe() raised RuntimeError: the driver crashed"
    assert "is not a backend class" in str(statuses["not-a-class"].reason)
    assert statuses["acme"].available and statuses["cpu"].available


# -- inferctl backends -----------------------------------------------------------------------------


def _inferctl_backends(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in (registry.ALLOWED_ENV, registry.PRIORITY_ENV)}
    environ.update(PYTHONPATH=str(site), **env)
    return subprocess.run([sys.executable, "-m", "inferflux.gateway.cli", "backends", *args], capture_output=True,
                          text=True, timeout=60, env=environ, cwd=Path(__file__).parents[2])


@pytest.mark.slow
def test_inferctl_backends_lists_every_backend_with_its_reason(acme_site: Path) -> None:
    table = _inferctl_backends(acme_site)
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:] if line.strip()}
    # BACKEND KIND PRIORITY AVAILABLE ...
    assert rows["acme"].split()[1:4] == ["engine", "-", "yes"] and "acme-inferflux 1.0" in rows["acme"]
    if platform.system() != "Darwin":
        assert rows["cpu"].split()[1:4] == ["engine", "3", "yes"]
        assert rows["metal"].split()[1:4] == ["engine", "2", "no"] and "Metal needs macOS" in rows["metal"]
    assert rows["openai"].split()[1:2] == ["remote"]
    assert "auto: " in table.stdout

    out = _inferctl_backends(acme_site, "--json", INFERFLUX_BACKEND_PRIORITY="acme,cpu", ACME_UNAVAILABLE="")
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)
    assert listing["priority"] == ["acme", "cpu"] and listing["auto"] == "acme"
    by_name = {b["name"]: b for b in listing["backends"]}
    assert by_name["acme"] == {"name": "acme", "available": True, "reason": None, "allowed": True,
                               "provider": "acme-inferflux 1.0", "target": f"{ACME_MODULE}:AcmeBackend", "kind": "engine",
                               "priority": 1}
    for b in listing["backends"]:
        assert (b["reason"] is None) == b["available"], b


@pytest.mark.slow
def test_inferctl_backends_honours_the_allow_list(acme_site: Path) -> None:
    out = _inferctl_backends(acme_site, "--json", INFERFLUX_BACKENDS_ALLOWED="cpu",
                             INFERFLUX_BACKEND_PRIORITY="acme,cpu")
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)
    by_name = {b["name"]: b for b in listing["backends"]}
    assert by_name["acme"]["allowed"] is False and by_name["acme"]["available"] is False
    assert "INFERFLUX_BACKENDS_ALLOWED" in by_name["acme"]["reason"]
    assert listing["auto"] == "cpu"
    assert not imported(acme_site)
    bad = _inferctl_backends(acme_site, INFERFLUX_BACKEND_PRIORITY="cpu,auto")
    assert bad.returncode == 2 and "'auto' is not a backend name" in bad.stderr


# -- settings and serving --------------------------------------------------------------------------


def test_backend_priority_setting_from_file_and_environment(tmp_path: Path) -> None:
    from inferflux.gateway.settings import ConfigError, load_settings

    config = tmp_path / "inferflux.yaml"
    config.write_text("runtime:\n  backend_priority: [mlx, cpu]\n")
    assert load_settings(config, env={}).runtime.backend_priority == ["mlx", "cpu"]
    assert load_settings(config, env={"INFERFLUX_BACKEND_PRIORITY": "cuda, cpu"}).runtime.backend_priority == [
        "cuda", "cpu"]
    defaults = load_settings(env={"XDG_DATA_HOME": str(tmp_path)})
    assert defaults.backend == "auto" and defaults.runtime.backend_priority is None
    with pytest.raises(ConfigError, match=r"runtime.backend_priority.*INFERFLUX_BACKEND_PRIORITY.*'auto'"):
        load_settings(config, env={"INFERFLUX_BACKEND_PRIORITY": "auto"})


@pytest.mark.model
def test_serving_through_the_chain_records_the_backend_chosen(
    acme_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inferflux.backends.base import ModelSpec
    from inferflux.backends.engine import EngineConfig
    from inferflux.backends.models import default_model_path
    from inferflux.gateway.models.served import load_served_model

    spec = ModelSpec(name="smollm2", path=default_model_path(), dtype="float32")
    served = load_served_model(spec, "auto", EngineConfig(num_blocks=8), priority=["acme", "cpu"])
    try:
        assert served.backend == "acme"
        assert type(served.engine.engine.backend).__module__ == ACME_MODULE
    finally:
        served.shutdown()
    monkeypatch.setenv("ACME_UNAVAILABLE", "switched off")
    with pytest.raises(BackendError, match="backend 'acme' cannot be used here: switched off"):
        load_served_model(spec, "acme", EngineConfig(num_blocks=8))


def test_the_openai_backend_is_listed_as_remote_and_auto_never_takes_it() -> None:
    statuses = {s.name: s for s in registry.statuses()}
    assert statuses["openai"].available and statuses["openai"].kind == "remote", statuses["openai"]
    assert statuses["cpu"].kind == "engine"
    # First in the chain, it is passed over: "auto" means weights run here.
    name, _ = registry.resolve(registry.AUTO, priority=["openai", "cpu"])
    assert name == "cpu"
    with pytest.raises(BackendError, match="a remote backend"):
        registry.resolve(registry.AUTO, priority=["openai"])



def test_each_builtin_engine_backend_names_its_kv_block_size() -> None:
    # The cuda and metal runners subclass the cpu backend: without their own setting they
    # would inherit its 8-token blocks, which their tiled kernels were not measured with.
    from inferflux.backends.base import default_block_size
    from inferflux.backends.cpu.backend import CPUBackend
    from inferflux.backends.cuda.backend import CUDABackend
    from inferflux.backends.metal.backend import MetalBackend
    from inferflux.backends.mlx.backend import MLXBackend

    sizes = [default_block_size(cls, 0) for cls in (CPUBackend, CUDABackend, MetalBackend, MLXBackend)]
    assert sizes == [8, 16, 16, 0]  # mlx: the engine's DEFAULT_BLOCK_SIZE
