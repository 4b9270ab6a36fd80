"""Server settings: defaults < YAML file < environment < command-line flags.

YAML file (``--config`` or ``INFERFLUX_CONFIG``), every key optional::

    host: 127.0.0.1
    port: 8080
    data_dir: ~/.local/share/inferflux
    log_level: info
    backend: auto           # default for models that name none: auto (the priority chain) or a backend name
    runtime:
      backend_priority: [cuda, metal, cpu, mlx]   # the chain 'auto' walks (default: backends.registry.default_priority)
    dtype: auto             # default for models that name none: auto | float32 | bfloat16
    max_body_bytes: 4MiB
    max_queued_sequences: 256   # per model; beyond it requests get 503 + Retry-After
    max_queued_sequences_per_tenant: 128   # per model and tenant; beyond it 429 tenant_queue_full
    input_limits:           # gateway.jsonbody, gateway.slowclients; breaches are 400s naming the field
      json_max_depth: 32    # nesting of arrays and objects
      json_max_integer_digits: 64
      json_max_string_length: 1048576   # characters, each string
      json_max_array_length: 131072
      json_max_object_keys: 1000
      stop_max_sequences: 16
      stop_max_bytes: 512   # each stop sequence, in UTF-8
      header_timeout_seconds: 10   # a connection's request headers must arrive within this
      body_timeout_seconds: 30     # and its body within this after them (else 408, closed)
      keep_alive_timeout_seconds: 5   # an idle keep-alive connection is closed after this
    engine:                 # backends.engine.EngineConfig; omitted keys keep its defaults
      kv_cache_bytes: 512MiB
      block_size: 16
      max_num_seqs: 64
      max_num_batched_tokens: 512
      max_model_len: 8192   # may only lower the model's context length
      preemption_mode: swap # recompute (default) | swap: park preempted KV instead of dropping it
      swap_space_bytes: 4GiB  # default: the KV cache's size
      swap_dir: /var/lib/inferflux/swap   # unset: swap to host memory
    models:
      - name: smollm2-135m-instruct
        path: /path/to/model.gguf
        backend: cpu        # optional
        dtype: float32      # optional
        aliases: [smollm2]
    store:                  # the policy store (policy.store.StoreSettings)
      url: postgresql://inferflux@db/inferflux   # default: SQLite at <data_dir>/policy.db
      key_file: /run/secrets/store.key   # or passphrase; neither: <data_dir>/store.key, made on first start
      auto_migrate: true    # false: refuse to start on an outdated schema ('inferctl db upgrade')
      stale_seconds: 300    # store unreachable: cached decisions serve this long, then 503
    auth:
      cache_ttl_seconds: 30         # longest a cached authentication decision lives
      revocation_poll_seconds: 1    # how often the store is checked for revocations and role changes
      last_used_flush_seconds: 5    # how often API keys' last-used times are written
    ratelimit:              # the limits themselves are policies in the store (admin API)
      backend: memory       # memory (one replica) | redis (limits shared by every replica)
      redis_url: redis://127.0.0.1:6379/0
      fail_open: false      # Redis unreachable: false -> 503, true -> admit and count the failure
      completion_estimate: 256   # tokens reserved for a request that sets no max_tokens
    server:
      shutdown_grace_seconds: 20   # SIGTERM: in-flight requests get this long, then streams end with an error
    audit:
      spool_dir: <data_dir>/audit   # one per replica; events are on disk here before a response
      retention_days: 90    # rows older than this leave the audit_events table
      debug_content: false  # true: events carry the (redacted) prompt and completion text
      min_free_bytes: 32MiB # less free beside the spool: new work gets 503, /readyz fails
      sinks:                # each delivers the spool at least once, with its own cursor
        - {type: file, path: /var/log/inferflux/audit.jsonl}
        - {type: syslog, host: siem.example.com, port: 6514, transport: tls, ca_file: /etc/ssl/siem.pem}
        - {type: http, url: https://splunk:8088/services/collector/event, format: splunk_hec,
           token_env: SPLUNK_HEC_TOKEN}

Environment variables (each sets the key beside it):

    INFERFLUX_CONFIG                 the YAML file itself
    INFERFLUX_HOST                   host
    INFERFLUX_PORT                   port
    INFERFLUX_DATA_DIR               data_dir
    INFERFLUX_LOG_LEVEL              log_level
    INFERFLUX_BACKEND                backend
    INFERFLUX_BACKEND_PRIORITY       runtime.backend_priority (comma separated)
    INFERFLUX_DTYPE                  dtype
    INFERFLUX_MODEL                  serve this one model (a path) instead of ``models``
    INFERFLUX_MODEL_NAME             the id clients use for INFERFLUX_MODEL
    INFERFLUX_KV_CACHE_BYTES         engine.kv_cache_bytes
    INFERFLUX_MAX_BODY_BYTES         max_body_bytes
    INFERFLUX_MAX_QUEUED_SEQUENCES   max_queued_sequences
    INFERFLUX_MAX_QUEUED_SEQUENCES_PER_TENANT   max_queued_sequences_per_tenant
    INFERFLUX_STORE_URL              store.url
    INFERFLUX_STORE_KEY_FILE         store.key_file
    INFERFLUX_STORE_PASSPHRASE       store.passphrase
    INFERFLUX_RATELIMIT_BACKEND      ratelimit.backend
    INFERFLUX_REDIS_URL              ratelimit.redis_url

The top-level ``backend`` and ``dtype`` are defaults: a model entry in the
file that names its own keeps it, whatever the environment or flags say.
Sizes accept plain bytes or a unit: ``64MiB``, ``2GiB`` (powers of 1024) or
``4M``, ``1.5GB`` (powers of 1000).
Without any ``models`` the default SmolLM2 is served as
``smollm2-135m-instruct``.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from backends.base import ModelSpec
from gateway.jsonbody import JsonLimits
from gateway.protocol import StopLimits
from policy.store.config import StoreSettings

log = logging.getLogger("inferflux.gateway.settings")

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class ConfigError(Exception):
    """The configuration is invalid; the message names the key and its source."""


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)b?|b)?\s*$", re.IGNORECASE)


def parse_size(value: Any) -> Any:
    """``"64MiB"`` -> 67108864, ``"4MB"`` / ``"4M"`` -> 4000000 (SI, as Kubernetes reads them).

    Ints pass through; anything else is left for pydantic to reject.
    """
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match:
            raise ValueError(f"not a size: {value!r} (use bytes or e.g. 64MiB, 2GB)")
        number, unit, binary = match.groups()
        power = "kmgt".index(unit.lower()) + 1 if unit else 0
        return int(float(number) * (1024 if binary else 1000) ** power)
    return value


ByteSize = Annotated[int, BeforeValidator(parse_size), Field(gt=0)]
Dtype = Literal["auto", "float32", "bfloat16"]
LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]


class SpeculativeSettings(BaseModel):
    """Speculative decoding for a model (``backends.engine.speculative.SpeculativeConfig``)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "draft"] = "ngram"
    k: int = Field(default=4, ge=1, le=16)
    min_ngram: int = Field(default=1, ge=1, le=16)
    max_ngram: int = Field(default=4, ge=1, le=16)
    max_batch: int = Field(default=8, ge=1)
    cooldown_steps: int = Field(default=16, ge=0)
    # method "draft": the model's own first N layers (a self-draft), or another
    # model with the same vocabulary (a path), loaded on the same backend.
    draft_layers: int | None = Field(default=None, ge=1)
    draft_model: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeSettings:
        if self.min_ngram > self.max_ngram:
            raise ValueError("min_ngram must not exceed max_ngram")
        drafts = (self.draft_layers is not None) + (self.draft_model is not None)
        if self.method == "draft" and drafts != 1:
            raise ValueError("method 'draft' needs draft_layers or draft_model (one of them)")
        if self.method == "ngram" and drafts:
            raise ValueError("draft_layers and draft_model apply to method 'draft' only")
        if self.draft_model is not None:
            self.draft_model = os.path.expanduser(self.draft_model)
        return self


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    backend: str | None = None
    dtype: Dtype | None = None
    aliases: list[str] = Field(default_factory=list)
    # This model's speculative decoding; unset: the engine section's (off by default).
    speculative: SpeculativeSettings | None = None


class EngineSettings(BaseModel):
    """Maps onto ``backends.engine.EngineConfig``; unset keys keep the engine's defaults."""

    model_config = ConfigDict(extra="forbid")

    kv_cache_bytes: ByteSize | None = None
    block_size: int | None = Field(default=None, gt=0)
    max_num_seqs: int | None = Field(default=None, gt=0)
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    max_model_len: int | None = Field(default=None, gt=0)
    enable_prefix_caching: bool | None = None  # engine default: on
    speculative: SpeculativeSettings | None = None  # every model's, unless its entry sets its own; unset: off
    # Each tenant's prompts reuse only that tenant's cached KV, so one tenant's
    # prompts can neither speed up nor be probed through another's timings.
    prefix_cache_per_tenant: bool = True
    # When KV memory runs out: drop a preempted sequence's KV and prefill it again
    # later (recompute), or park it in swap space and copy it back (swap). Swap
    # space lives in host memory, or in a file under swap_dir (the useful tier for
    # the cpu backend); its size defaults to the KV cache's.
    preemption_mode: Literal["recompute", "swap"] | None = None  # engine default: recompute
    swap_space_bytes: ByteSize | None = None
    swap_dir: str | None = Field(default=None, min_length=1)

    @field_validator("swap_dir")
    @classmethod
    def _expand_swap_dir(cls, value: str | None) -> str | None:
        return None if value is None else os.path.expanduser(value)


class AuthSettings(BaseModel):
    """How long authentication decisions are cached (see ``gateway.auth``)."""

    model_config = ConfigDict(extra="forbid")

    # Upper bound on how long a cached decision lives, whatever happens.
    cache_ttl_seconds: float = Field(default=30.0, ge=0, le=3600)
    # How often each replica checks the store for changes; a revoked key or a
    # changed role stops working everywhere within about this long.
    revocation_poll_seconds: float = Field(default=1.0, gt=0, le=60)
    # API keys' last-used times are written in batches this often.
    last_used_flush_seconds: float = Field(default=5.0, gt=0, le=3600)


class RateLimitSettings(BaseModel):
    """Where rate-limit counters live (``policy.ratelimit``); the limits are store policies."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = Field(default="inferflux:rl", min_length=1, max_length=64)
    redis_timeout_seconds: float = Field(default=0.5, gt=0, le=30)
    fail_open: bool = False
    completion_estimate: int = Field(default=256, ge=1)


class AuditSinkSettings(BaseModel):
    """One SIEM sink; which keys apply depends on ``type``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["file", "syslog", "http"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]{1,64}$")
    # file
    path: Path | None = None
    max_bytes: ByteSize = 100 * 1024 * 1024
    backups: int = Field(default=10, ge=0)
    # syslog
    host: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    transport: Literal["udp", "tcp", "tls"] = "tls"
    ca_file: Path | None = None
    server_name: str | None = None
    # http
    url: str | None = None
    format: Literal["json", "splunk_hec"] = "json"
    # The token is read from this environment variable at start-up, so that it
    # is neither in the configuration file nor in the logs.
    token_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")

    @model_validator(mode="after")
    def _complete(self) -> AuditSinkSettings:
        needed = {"file": ("path",), "syslog": ("host", "port"), "http": ("url",)}[self.type]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.type} sink needs {', '.join(missing)}")
        return self


class AuditSettings(BaseModel):
    """The audit trail (``policy.audit``)."""

    model_config = ConfigDict(extra="forbid")

    spool_dir: Path | None = None  # default: <data_dir>/audit
    chain_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]{1,64}$")
    # Every answered request's event is written to the spool (in the kernel) before
    # the answer, so a crash or kill -9 of the gateway loses none. True also waits
    # for its fsync, so a crash of the machine loses none either: one disk flush
    # of latency per answer.
    wait_durable: bool = False
    # Without wait_durable, the spool fsyncs at most once per this interval: a
    # crash of the machine can lose the events of the last interval (a crash of
    # the gateway still loses none); a trickle of requests then wakes the fsync
    # thread once per interval instead of once per request. Not used with
    # wait_durable, whose answers each wait for an fsync that starts at once.
    fsync_interval_seconds: float = Field(default=0.1, ge=0, le=10)
    debug_content: bool = False
    retention_days: float = Field(default=90.0, gt=0)
    # Each sink (and the store's index) waits this long after the first new
    # event to gather a batch: fewer sends and commits competing with requests
    # for the CPU, at the cost of that much delivery delay (and of admin audit
    # queries lagging by as much). 0 sends at once.
    sink_linger_seconds: float = Field(default=1.0, ge=0, le=60)
    # Below this much free space where the spool lives, new work (generation,
    # admin changes) is refused with 503 and /readyz fails, while the events of
    # the work in flight still fit on the disk (0: off; a full disk still fails closed).
    min_free_bytes: Annotated[int, BeforeValidator(parse_size), Field(ge=0)] = 32 * 1024 * 1024
    sinks: list[AuditSinkSettings] = Field(default_factory=list)
    # Refusals (401, 403, 404, 422, 429, ...): the first of a (caller, route, status, reason)
    # is written at once, repeats within this window are counted into one event at its end,
    # so a flood of forged credentials cannot fill the disk. 0 writes every refusal.
    refusal_aggregation_seconds: float = Field(default=10.0, ge=0, le=3600)
    # A signed checkpoint of the chain's head (kept in the store and written to the chain)
    # after this many events or this many seconds, whichever comes first: what
    # `inferctl audit verify --checkpoints` needs to see a cut tail.
    checkpoint_every_events: int = Field(default=1000, ge=1, le=1_000_000)
    checkpoint_interval_seconds: float = Field(default=60.0, gt=0, le=86400)


class ServerSettings(BaseModel):
    """How ``inferctl serve`` stops (``gateway.drain``)."""

    model_config = ConfigDict(extra="forbid")

    # On SIGTERM /readyz fails and new requests get 503 at once; requests in
    # flight get this long to finish, then streams end with an error event and
    # [DONE]. Keep it below the orchestrator's own limit (Kubernetes:
    # terminationGracePeriodSeconds, 30 s by default): the process exits a few
    # seconds after it.
    shutdown_grace_seconds: float = Field(default=20.0, ge=0, le=3600)


class InputLimitSettings(BaseModel):
    """Bounds on what one request may ask of the gateway beyond ``max_body_bytes`` (``gateway.jsonbody``,
    ``gateway.slowclients``); each breach is a 400 naming the field, or a closed connection."""

    model_config = ConfigDict(extra="forbid")

    json_max_depth: int = Field(default=32, ge=2, le=256)
    json_max_integer_digits: int = Field(default=64, ge=20, le=4000)  # 20: every 64-bit integer
    json_max_string_length: int = Field(default=1024 * 1024, ge=1)  # characters
    json_max_array_length: int = Field(default=131_072, ge=1)
    json_max_object_keys: int = Field(default=1000, ge=1)
    stop_max_sequences: int = Field(default=16, ge=1, le=64)  # 64: the engine's MAX_STOP_STRINGS
    stop_max_bytes: int = Field(default=512, ge=1, le=64 * 1024)  # each, UTF-8
    # Slow clients: a connection must deliver a request's headers this long after
    # it opens (or after the previous answer), and its body this long after the
    # headers; an idle keep-alive connection is closed after keep_alive_timeout.
    header_timeout_seconds: float = Field(default=10.0, gt=0, le=600)
    body_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    keep_alive_timeout_seconds: int = Field(default=5, ge=1, le=600)

    def stop_limits(self) -> StopLimits:
        return StopLimits(max_sequences=self.stop_max_sequences, max_bytes=self.stop_max_bytes)

    def json_limits(self, *, allow_nul: bool = True) -> JsonLimits:
        """The decoder's limits; ``allow_nul`` False for bodies the store keeps (PostgreSQL refuses U+0000)."""
        return JsonLimits(
            max_depth=self.json_max_depth,
            max_integer_digits=self.json_max_integer_digits,
            max_string_length=self.json_max_string_length,
            max_array_length=self.json_max_array_length,
            max_object_keys=self.json_max_object_keys,
            allow_nul=allow_nul,
        )


def _split_names(value: Any) -> Any:
    """``"cuda, cpu"`` (an environment variable) -> ``["cuda", "cpu"]``; lists pass through."""
    return [item.strip() for item in value.split(",") if item.strip()] if isinstance(value, str) else value


class RuntimeSettings(BaseModel):
    """Which backend ``backend: auto`` picks (``backends.registry``)."""

    model_config = ConfigDict(extra="forbid")

    # Tried in order; the first allowed backend whose probe passes serves. Unset:
    # the registry's default chain (cuda, metal, then cpu before mlx-on-Linux).
    backend_priority: Annotated[list[str] | None, BeforeValidator(_split_names)] = None

    @field_validator("backend_priority")
    @classmethod
    def _names(cls, names: list[str] | None) -> list[str] | None:
        if names is None:
            return None
        from backends.base import BackendError
        from backends.registry import parse_names

        try:
            return list(parse_names(names, "backend_priority"))
        except BackendError as exc:
            raise ValueError(str(exc)) from None


def default_data_dir(env: Mapping[str, str] | None = None) -> Path:
    xdg = (os.environ if env is None else env).get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "inferflux"


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)
    data_dir: Path = Field(default_factory=default_data_dir)
    log_level: LogLevel = "info"
    # "auto": the first available backend of runtime.backend_priority (see backends.registry).
    backend: str = Field(default="auto", min_length=1)
    dtype: Dtype = "auto"
    max_body_bytes: ByteSize = DEFAULT_MAX_BODY_BYTES
    # Per model: a request that would make more sequences wait than this gets
    # 503 with Retry-After instead of joining an ever-longer queue.
    max_queued_sequences: int = Field(default=256, ge=1)
    # Of those, what one tenant may hold: its flood queues no deeper than this, so the rest of
    # the queue stays open to the other tenants (the scheduler then shares the batch fairly).
    max_queued_sequences_per_tenant: int = Field(default=128, ge=1)
    input_limits: InputLimitSettings = Field(default_factory=InputLimitSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    models: list[ModelEntry] = Field(default_factory=list)
    store: StoreSettings = Field(default_factory=StoreSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    ratelimit: RateLimitSettings = Field(default_factory=RateLimitSettings)
    audit: AuditSettings = Field(default_factory=AuditSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)

    @field_validator("data_dir", mode="before")
    @classmethod
    def _expand(cls, value: Any) -> Any:
        return Path(value).expanduser() if isinstance(value, str | Path) else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("models")
    @classmethod
    def _unique(cls, models: list[ModelEntry]) -> list[ModelEntry]:
        seen: set[str] = set()
        for entry in models:
            for key in (entry.name, *entry.aliases):
                if key in seen:
                    raise ValueError(f"model name or alias {key!r} appears twice")
                seen.add(key)
        return models

    def model_specs(self) -> list[tuple[ModelSpec, str]]:
        """Each model to serve with its backend name; the default SmolLM2 if none is configured."""
        entries = self.models or [ModelEntry(name=DEFAULT_MODEL_NAME, path=_default_model_path(), aliases=["smollm2"])]
        return [
            (
                ModelSpec(
                    name=e.name,
                    path=e.path,
                    dtype=e.dtype or self.dtype,
                    aliases=tuple(e.aliases),
                ),
                e.backend or self.backend,
            )
            for e in entries
        ]


    def model_speculative(self, name: str) -> SpeculativeSettings | None:
        """The ``speculative`` section of the configured model ``name`` (None: it sets none)."""
        return next((e.speculative for e in self.models if e.name == name), None)


def _default_model_path() -> str:
    from backends.models import default_model_path

    return default_model_path()


# Environment variable -> dotted settings key.
ENV_KEYS: dict[str, str] = {
    "INFERFLUX_HOST": "host",
    "INFERFLUX_PORT": "port",
    "INFERFLUX_DATA_DIR": "data_dir",
    "INFERFLUX_LOG_LEVEL": "log_level",
    "INFERFLUX_BACKEND": "backend",
    "INFERFLUX_BACKEND_PRIORITY": "runtime.backend_priority",
    "INFERFLUX_DTYPE": "dtype",
    "INFERFLUX_MODEL": "model",
    "INFERFLUX_MODEL_NAME": "model_name",
    "INFERFLUX_KV_CACHE_BYTES": "engine.kv_cache_bytes",
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
        if Path(path).resolve() == Path(_default_model_path()).resolve():
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


def _loc_to_key(loc: tuple[int | str, ...]) -> str:
    out = ""
    for item in loc:
        out += f"[{item}]" if isinstance(item, int) else (f".{item}" if out else str(item))
    return out


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
        first = exc.errors(include_url=False)[0]
        loc = tuple(first.get("loc", ()))
        key = _loc_to_key(loc) or "(top level)"
        source = sources.get(key) or (sources.get(str(loc[0])) if loc else None) or "defaults"
        message = first.get("msg", "invalid value")
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        if first.get("type") == "extra_forbidden":
            message = "unknown setting"
        raise ConfigError(f"invalid setting {key!r} (from {source}): {message}") from None


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
