"""Building ``Settings`` from its sources: defaults < YAML file < environment < command-line flags.

Which environment variable sets which key is ``ENV_KEYS`` (listed in the
package docstring too). A bad value is a ``ConfigError`` that names the key
and the source it came from, so an operator knows which of the four to fix.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from inferflux.gateway.validation_errors import first_error
from inferflux.gateway.settings.schema import DEFAULT_MODEL_NAME, Settings, default_data_dir, default_model_path

log = logging.getLogger("inferflux.gateway.settings")


class ConfigError(Exception):
    """The configuration is invalid; the message names the key and its source."""


# Environment variable -> dotted settings key.
ENV_KEYS: dict[str, str] = {
    "INFERFLUX_HOST": "host",
    "INFERFLUX_PORT": "port",
    "INFERFLUX_DATA_DIR": "data_dir",
    "INFERFLUX_LOG_LEVEL": "log_level",
    "INFERFLUX_LOG_FORMAT": "log_format",
    "INFERFLUX_TRACING": "tracing.enabled",
    "INFERFLUX_WEBSOCKET": "websocket.enabled",
    "INFERFLUX_BACKEND": "backend",
    "INFERFLUX_BACKEND_PRIORITY": "runtime.backend_priority",
    "INFERFLUX_CPU_ISA": "runtime.cpu_isa",
    "INFERFLUX_DTYPE": "dtype",
    "INFERFLUX_MODEL": "model",
    "INFERFLUX_MODEL_NAME": "model_name",
    "INFERFLUX_KV_CACHE_BYTES": "engine.kv_cache_bytes",
    "INFERFLUX_REGISTRY_PATH": "registry.path",
    "INFERFLUX_REGISTRY_POLL_INTERVAL_SECONDS": "registry.poll_interval_seconds",
    "INFERFLUX_MAX_BODY_BYTES": "max_body_bytes",
    "INFERFLUX_MAX_QUEUED_SEQUENCES": "max_queued_sequences",
    "INFERFLUX_MAX_QUEUED_SEQUENCES_PER_TENANT": "max_queued_sequences_per_tenant",
    "INFERFLUX_STORE_URL": "store.url",
    "INFERFLUX_STORE_KEY_FILE": "store.key_file",
    "INFERFLUX_STORE_PASSPHRASE": "store.passphrase",
    "INFERFLUX_RATELIMIT_BACKEND": "ratelimit.backend",
    "INFERFLUX_REDIS_URL": "ratelimit.redis_url",
}


def _model_name_from_path(path: str) -> str:
    try:
        if Path(path).resolve() == Path(default_model_path()).resolve():
            return DEFAULT_MODEL_NAME
    except Exception:  # no default model installed; fall back to the file name
        pass
    stem = Path(path.rstrip("/")).name
    if stem.lower().endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    return stem.lower() or "model"


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child
    node[leaf] = value


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must contain a mapping of settings at the top level")
    return data


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build Settings from the file, the environment and ``overrides`` (CLI flags, dotted keys).

    ``overrides`` values that are None are ignored, so argparse results can be
    passed as they are. Raises ConfigError with the offending key and where it
    came from.
    """
    env = os.environ if env is None else env
    config_file = config_file or env.get("INFERFLUX_CONFIG") or None
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config_file:
        path = Path(config_file).expanduser()
        data = _read_yaml(path)
        sources = {key: f"config file {path}" for key in data}

    layers: list[tuple[str, dict[str, Any]]] = [
        ("env", {key: (env[var], var) for var, key in ENV_KEYS.items() if env.get(var) not in (None, "")}),
        ("flag", {key: (value, f"--{key.split('.')[-1].replace('_', '-')}") for key, value in (overrides or {}).items() if value is not None}),
    ]
    for _, layer in layers:
        for key, (value, source) in layer.items():
            _set(data, key, value)
            sources[key.split(".")[0]] = source
            sources[key] = source

    data.setdefault("data_dir", default_data_dir(env))
    # A single model given by path replaces the configured list.
    model_path = data.pop("model", None)
    model_name = data.pop("model_name", None)
    if model_path is not None:
        data["models"] = [{"name": model_name or _model_name_from_path(str(model_path)), "path": str(model_path)}]
        sources["models"] = sources.get("model", "--model")
    elif model_name is not None:
        raise ConfigError(f"{sources.get('model_name', 'model_name')} is set but no model path is given with it")

    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        first = first_error(exc, unknown="unknown setting")
        key = first.path or "(top level)"
        source = sources.get(key) or (sources.get(str(first.loc[0])) if first.loc else None) or "defaults"
        raise ConfigError(f"invalid setting {key!r} (from {source}): {first.message}") from None


def ensure_data_dir(path: Path) -> Path:
    """Create the data directory owner-only; it will hold keys and audit spools."""
    if not path.exists():
        path.mkdir(parents=True, mode=0o700)
        path.chmod(0o700)  # mkdir's mode is masked by the umask
    elif not path.is_dir():
        raise ConfigError(f"data_dir {path} exists and is not a directory")
    else:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            log.warning("data directory %s is accessible to other users (mode %o); 0700 is advised", path, mode)
    return path
