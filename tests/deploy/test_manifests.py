"""The Kubernetes manifests (deploy/kubernetes) render, validate, and agree with the code.

Each overlay is rendered with ``kubectl kustomize`` (offline; Debian's kubectl, which the
CI machines have at /usr/bin/kubectl: no PyPI package renders kustomize) and every object
is validated against the Kubernetes API schemas of ``K8S_VERSION`` by the
``kubernetes-validate`` package, strictly (an unknown or misspelt field is an error). The
ServiceMonitor is a Prometheus Operator CRD, absent from those schemas: its required
fields are checked here instead. Beyond the schemas, what a schema cannot know: every
container is hardened (non-root, read-only root filesystem, no capabilities, seccomp),
probes point at the gateway's real health routes, limits are set, the image is pinned,
the HPA's metric is one the gateway exports, the INFERFLUX_* variables are ones the
settings read, and each overlay's settings file loads with ``gateway.settings``.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferflux.gateway.auth import PUBLIC_PATHS
from inferflux.gateway.metrics import _ENGINE_METRICS
from inferflux.gateway.routes import health
from inferflux.gateway.settings import ENV_KEYS, load_settings

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE_DIR = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("gateway-upstream", "cpu-engine")
# The Kubernetes release whose API schemas the objects must satisfy.
K8S_VERSION = "1.33"
# Custom resources: not in kubernetes-validate's schemas, checked by check_service_monitor.
CRD_KINDS = frozenset({"ServiceMonitor"})
# INFERFLUX_* variables read outside ENV_KEYS (gateway/settings/loading.py, gateway/cli/operator.py).
EXTRA_ENV = frozenset({"INFERFLUX_CONFIG", "INFERFLUX_BOOTSTRAP_ADMIN_KEY"})
HEALTH_PATHS = {route.path for route in health.routes()}  # type: ignore[attr-defined]
ENGINE_METRICS = {name for _, name, _, _ in _ENGINE_METRICS}
METRICS_PATH = "/metrics"
UID = 10001  # the image's user (deploy/Dockerfile)


def kubectl() -> str:
    """kubectl's path; a missing kubectl fails the test (CI must render the manifests), never skips it."""
    found = shutil.which("kubectl") or ("/usr/bin/kubectl" if os.access("/usr/bin/kubectl", os.X_OK) else None)
    if found is None:
        pytest.fail(
            "kubectl is not installed: these tests render the manifests with `kubectl kustomize` "
            "(Debian: apt-get install kubectl; the CI machines have it at /usr/bin/kubectl)"
        )
    return found


def render(path: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(KUSTOMIZE_DIR / "overlays" / request.param)


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = of_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def validate(obj: dict[str, Any]) -> None:
    """Validate ``obj`` against the Kubernetes schemas (strict); raises kubernetes_validate's errors."""
    from kubernetes_validate import utils

    utils.validate(obj, K8S_VERSION, strict=True)


def check_service_monitor(monitor: dict[str, Any], services: list[dict[str, Any]]) -> list[str]:
    """What the Prometheus Operator needs of a ServiceMonitor, and that it scrapes our route."""
    problems = []
    if monitor.get("apiVersion") != "monitoring.coreos.com/v1":
        problems.append(f"apiVersion {monitor.get('apiVersion')!r}")
    if not monitor.get("metadata", {}).get("name"):
        problems.append("no metadata.name")
    spec = monitor.get("spec") or {}
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    matched = [s for s in services if selector and selector.items() <= s["metadata"].get("labels", {}).items()]
    if not matched:
        problems.append(f"selector {selector} matches no Service")
    port_names = {port.get("name") for service in matched for port in service["spec"]["ports"]}
    endpoints = spec.get("endpoints") or []
    if not endpoints:
        problems.append("no endpoints")
    for endpoint in endpoints:
        if endpoint.get("port") not in port_names:
            problems.append(f"endpoint port {endpoint.get('port')!r} is not a port of the selected Service")
        if endpoint.get("path", "/metrics") != METRICS_PATH:
            problems.append(f"endpoint path {endpoint.get('path')!r} is not {METRICS_PATH}")
    return problems


def containers(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) for every container of every workload."""
    for workload in of_kind(objects, "Deployment"):
        pod = workload["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            yield pod, container


def hardening_problems(pod: dict[str, Any], container: dict[str, Any]) -> list[str]:
    pod_sc, sc = pod.get("securityContext") or {}, container.get("securityContext") or {}
    name = container["name"]
    problems = []
    if not (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot")):
        problems.append(f"{name}: runAsNonRoot is not set")
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    if uid in (None, 0):
        problems.append(f"{name}: runAsUser {uid!r} (want a fixed non-zero UID)")
    if sc.get("readOnlyRootFilesystem") is not True:
        problems.append(f"{name}: the root filesystem is writable")
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{name}: allowPrivilegeEscalation is not false")
    if sc.get("privileged"):
        problems.append(f"{name}: privileged")
    if "ALL" not in (sc.get("capabilities") or {}).get("drop", []) or (sc.get("capabilities") or {}).get("add"):
        problems.append(f"{name}: capabilities are not all dropped")
    seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        problems.append(f"{name}: seccomp profile {seccomp!r}")
    limits = (container.get("resources") or {}).get("limits") or {}
    requests = (container.get("resources") or {}).get("requests") or {}
    for resource in ("cpu", "memory"):
        if resource not in limits or resource not in requests:
            problems.append(f"{name}: no {resource} request and limit")
    image = container.get("image", "")
    tag = image.rsplit("/", 1)[-1].partition("@")[0].partition(":")[2]
    if "@sha256:" not in image and tag in ("", "latest"):
        problems.append(f"{name}: image {image!r} is not pinned to a tag other than latest")
    if pod.get("enableServiceLinks") is not False:
        problems.append("enableServiceLinks is not false (a Service named inferflux sets INFERFLUX_PORT)")
    if pod.get("automountServiceAccountToken") is not False:
        problems.append("a service account token is mounted")
    return problems


def probe_problems(container: dict[str, Any]) -> list[str]:
    ports = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
    expected = {"startupProbe": "/livez", "livenessProbe": "/livez", "readinessProbe": "/readyz"}
    problems = []
    for probe_name, path in expected.items():
        get = (container.get(probe_name) or {}).get("httpGet")
        if get is None:
            problems.append(f"no HTTP {probe_name}")
            continue
        if get["path"] != path or get["path"] not in HEALTH_PATHS:
            problems.append(f"{probe_name} probes {get['path']!r}, not the gateway's {path}")
        if get["port"] not in ports and get["port"] not in ports.values():
            problems.append(f"{probe_name} probes port {get['port']!r}, which the container does not declare")
    return problems


# -- the tests ---------------------------------------------------------------------


def test_every_object_validates_against_the_kubernetes_schemas(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, objects = rendered
    kinds = {obj["kind"] for obj in objects}
    expected = {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap",
                "NetworkPolicy", "ServiceMonitor", "ServiceAccount"}  # fmt: skip
    assert expected <= kinds, f"{overlay} lacks {expected - kinds}"
    failures = []
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            failures += [f"ServiceMonitor: {p}" for p in check_service_monitor(obj, of_kind(objects, "Service"))]
            continue
        try:
            validate(obj)
        except Exception as exc:  # kubernetes_validate's ValidationError, SchemaNotFoundError, ...
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {getattr(exc, 'message', exc)}")
    assert not failures, f"{overlay}:\n" + "\n".join(failures)


def test_the_validation_catches_a_misspelt_field(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """The check above can fail: strict schemas refuse a field Kubernetes would silently drop."""
    from kubernetes_validate.utils import ValidationError

    deployment = copy.deepcopy(one(rendered[1], "Deployment"))
    validate(deployment)
    security = deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    security["readOnlyRootFilesytem"] = security.pop("readOnlyRootFilesystem")
    with pytest.raises(ValidationError):
        validate(deployment)


def test_containers_are_hardened_probed_and_limited(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, objects = rendered
    problems = []
    for pod, container in containers(objects):
        problems += hardening_problems(pod, container) + probe_problems(container)
        uid = (container.get("securityContext") or {}).get("runAsUser", pod["securityContext"].get("runAsUser"))
        if uid != UID:
            problems.append(f"runAsUser {uid}, not the image's user {UID}")
        writable = {mount["mountPath"] for mount in container.get("volumeMounts", []) if not mount.get("readOnly")}
        if not {"/tmp", "/var/lib/inferflux"} <= writable:
            problems.append(f"/tmp and the data directory need writable volumes (have {sorted(writable)})")
    assert not problems, f"{overlay}:\n" + "\n".join(problems)


def test_the_hardening_check_finds_a_root_container(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    pod, container = copy.deepcopy(next(containers(rendered[1])))
    assert hardening_problems(pod, container) == [] and probe_problems(container) == []
    container["securityContext"].update(runAsUser=0, readOnlyRootFilesystem=False)
    pod["securityContext"].pop("runAsUser")
    container["image"] = "registry.example.com/inferflux:latest"
    container["readinessProbe"]["httpGet"]["path"] = "/healthz"
    found = " ".join(hardening_problems(pod, container) + probe_problems(container))
    for expected in ("runAsUser 0", "root filesystem is writable", "latest", "readinessProbe probes '/healthz'"):
        assert expected in found


def test_objects_refer_to_each_other(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """Selectors select the pods, the HPA scales the Deployment on a metric the gateway exports,
    the Service and NetworkPolicy name the container's port, the env names the generated ConfigMaps."""
    overlay, objects = rendered
    deployment = one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = {
        "Deployment": deployment["spec"]["selector"]["matchLabels"],
        "Service": one(objects, "Service")["spec"]["selector"],
        "PodDisruptionBudget": one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
        "NetworkPolicy": one(objects, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"],
    }
    for kind, selector in selectors.items():
        assert selector and selector.items() <= pod_labels.items(), f"{overlay}: the {kind} selects no pod"

    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] == deployment["spec"]["replicas"] == 3
    for metric in hpa["spec"]["metrics"]:
        if metric["type"] == "Pods":
            assert metric["pods"]["metric"]["name"] in ENGINE_METRICS, metric
        else:
            assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu", metric

    container = deployment["spec"]["template"]["spec"]["containers"][0]
    port_names = {port["name"] for port in container["ports"]}
    assert {port["targetPort"] for port in one(objects, "Service")["spec"]["ports"]} <= port_names
    assert {p["port"] for rule in one(objects, "NetworkPolicy")["spec"]["ingress"] for p in rule["ports"]} <= port_names
    assert METRICS_PATH in PUBLIC_PATHS and HEALTH_PATHS <= PUBLIC_PATHS  # scraped and probed without credentials

    config_maps = {cm["metadata"]["name"] for cm in of_kind(objects, "ConfigMap")}
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    # An optional ConfigMap (the model manifests) is the operator's to create; the pod starts without it.
    referred = [v["configMap"]["name"] for v in volumes if "configMap" in v and not v["configMap"].get("optional")]
    referred += [source["configMapRef"]["name"] for source in container.get("envFrom", [])]
    assert referred and set(referred) <= config_maps, (referred, config_maps)


def settings_of(objects: list[dict[str, Any]], tmp_path: Path) -> tuple[Any, dict[str, str]]:
    """The settings a pod would load: its config file, its ConfigMap environment, its secrets as placeholders."""
    deployment = one(objects, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env_maps = {source["configMapRef"]["name"] for source in container.get("envFrom", [])}
    env: dict[str, str] = {}
    for cm in of_kind(objects, "ConfigMap"):
        if cm["metadata"]["name"] in env_maps:
            env.update(cm["data"])
    placeholders = {
        "INFERFLUX_STORE_URL": "postgresql://inferflux:secret@db.example:5432/inferflux",
        "INFERFLUX_REDIS_URL": "redis://:secret@redis.example:6379/0",
        "INFERFLUX_STORE_PASSPHRASE": "a passphrase",
    }
    for var in container.get("env", []):
        env[var["name"]] = var.get("value") or placeholders.get(var["name"], "from-a-secret")
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    config_path = Path(env["INFERFLUX_CONFIG"])
    assert config_path.parent == Path(mount["mountPath"]), "INFERFLUX_CONFIG is not in the mounted ConfigMap"
    files = next(cm["data"] for cm in of_kind(objects, "ConfigMap") if config_path.name in cm.get("data", {}))
    local = tmp_path / config_path.name
    local.write_text(files[config_path.name])
    env["INFERFLUX_CONFIG"] = str(local)
    env["INFERFLUX_DATA_DIR"] = str(tmp_path / "data")  # the image's, read by every inferctl command
    return load_settings(env=env), env


def test_each_settings_file_loads_and_shares_the_store_and_limits(
    rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    from inferflux.gateway.settings import ModelEntry

    overlay, objects = rendered
    if overlay == "gateway-upstream" and "upstream" not in ModelEntry.model_fields:
        pytest.skip("the openai backend's settings (models[].upstream, issue 20 point 1) are not in this tree yet")
    settings, env = settings_of(objects, tmp_path)
    assert settings.store.url is not None and settings.store.url.startswith("postgresql://")
    assert settings.ratelimit.backend == "redis" and not settings.ratelimit.fail_open
    assert settings.server.shutdown_grace_seconds + 5 < one(objects, "Deployment")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ], "the drain and the preStop sleep must end before Kubernetes kills the pod"
    unknown = {name for name in env if name.startswith("INFERFLUX_")} - set(ENV_KEYS) - EXTRA_ENV
    upstreams = [entry.upstream for entry in settings.models if getattr(entry, "upstream", None)]
    key_envs = {upstream.api_key_env for upstream in upstreams}
    assert unknown <= key_envs, f"{overlay}: variables nothing reads: {unknown - key_envs}"
    for name in key_envs:
        assert name in env, f"{overlay}: {name} (an upstream's api_key_env) is not set in the pod"
    if settings.registry.path is not None:  # the model manifests: a volume every replica mounts
        container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
        mounts = {Path(mount["mountPath"]) for mount in container["volumeMounts"]}
        assert settings.registry.path in mounts, f"{overlay}: registry.path is not a mounted volume"
    if overlay == "cpu-engine":
        assert settings.backend == "cpu" and settings.models == []  # the default SmolLM2
        assert settings.registry.path is not None  # and the manifests' directory
    else:
        assert [m.backend for m in settings.models] == ["openai"] * len(settings.models) and settings.models
        assert settings.upstreams.allowed_hosts  # type: ignore[attr-defined]


def test_the_base_renders_too() -> None:
    """The base alone (what an operator's own overlay starts from) renders and validates."""
    objects = render(KUSTOMIZE_DIR / "base")
    for obj in objects:
        if obj["kind"] not in CRD_KINDS:
            validate(obj)
