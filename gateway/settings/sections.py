"""The settings' value types, and the gateway's sections: one pydantic model per YAML section.

Each section maps onto the component that reads it (named in its docstring),
so a new knob goes beside its section's siblings and the component's default.
The sections of the inference side (models, engine, grammars, the backend
chain) are in ``gateway.settings.engine``, the upstream sections in
``gateway.settings.upstreams``. The whole file's reference, with every key, is
the package docstring (``gateway.settings``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from inferflux.gateway.pipeline.body import JsonLimits, SchemaLimits
from inferflux.gateway.pipeline.sampling import StopLimits

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
LogFormat = Literal["text", "json"]  # json: one object a line (gateway.logs.structured)


class ConsoleSettings(BaseModel):
    """The web console (``gateway.console``): whether it is served, how long its sessions live, and how
    often a source may fail to sign in."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    session_seconds: float = Field(default=8 * 3600.0, ge=60, le=7 * 86400)
    idle_seconds: float = Field(default=1800.0, ge=60, le=86400)
    # A source (an address; an IPv6 /64) that fails to sign in with an API key this many times within
    # the window gets 429 with Retry-After until its oldest failure leaves it (gateway.console.throttle).
    sign_in_failures: int = Field(default=5, ge=1, le=1000)
    sign_in_window_seconds: float = Field(default=60.0, ge=1, le=86400)


class WebSocketSettings(BaseModel):
    """The WebSocket front door at ``/v1/websocket`` (``gateway.websocket``): several streamed requests on one
    connection, each through the same policy chain as its HTTP route."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    # Requests one connection may have running at once; one more is refused with a 429-shaped error event.
    max_in_flight: int = Field(default=8, ge=1, le=1024)
    # A client message larger than this gets a 413-shaped error event (the connection stays open); one over
    # twice this is closed by the server with 1009, unread.
    max_message_bytes: ByteSize = 4 * 1024 * 1024
    # The server pings every this many seconds (protocol pings, which every client library answers); a peer
    # that has not answered within as long again is closed.
    ping_interval_seconds: float = Field(default=20.0, gt=0, le=3600)
    # A connection with nothing in flight that sends nothing for this long is closed (1000).
    idle_timeout_seconds: float = Field(default=300.0, gt=0, le=86400)


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


class ModelRegistrySettings(BaseModel):
    """How each replica follows the admin API's models in the store (``gateway.models.sync``)."""

    model_config = ConfigDict(extra="forbid")

    # How often the store is checked for models loaded, unloaded or made the
    # default through another replica; one changed there is taken up here within
    # about this long (plus its load time).
    poll_seconds: float = Field(default=1.0, gt=0, le=60)


class ManifestRegistrySettings(BaseModel):
    """A directory of model manifests each replica polls (``gateway.models.manifests``): one YAML file a
    model, the same keys as a ``models:`` entry; a file added, changed or removed loads, reloads or drains
    its model without a restart."""

    model_config = ConfigDict(extra="forbid")

    path: Path | None = None  # unset: no manifests
    # How often the directory is read; a changed file is loaded (and swapped in) within about this long
    # plus its load time. 0.1 s at least: each poll hashes every manifest.
    poll_interval_seconds: float = Field(default=5.0, ge=0.1, le=3600)
    # A larger file is reported as bad, unread: a manifest is a few lines.
    max_manifest_bytes: ByteSize = Field(default=64 * 1024, le=1024 * 1024)

    @field_validator("path", mode="before")
    @classmethod
    def _expand(cls, value: Any) -> Any:
        return Path(value).expanduser() if isinstance(value, str) and value else value


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
    """How ``inferctl serve`` stops (``gateway.drain``) and how long it writes to a client that reads
    nothing (``gateway.slowclients``)."""

    model_config = ConfigDict(extra="forbid")

    # A response (a stream, in practice) whose client takes none of it for this long
    # while the server has more to send is ended: the connection is closed, its
    # sequence aborted and its KV freed at once, its audit event saying client_timeout.
    # A stream's client reading tokens as they come never waits this long.
    stream_write_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)

    # On SIGTERM /readyz fails and new requests get 503 at once; requests in
    # flight get this long to finish, then streams end with an error event and
    # [DONE]. Keep it below the orchestrator's own limit (Kubernetes:
    # terminationGracePeriodSeconds, 30 s by default): the process exits a few
    # seconds after it.
    shutdown_grace_seconds: float = Field(default=20.0, ge=0, le=3600)


class TracingSettings(BaseModel):
    """OpenTelemetry traces (``gateway.tracing``); the standard ``OTEL_*`` variables configure the
    exporter, endpoint, service name, sampler and propagators."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False


class InputLimitSettings(BaseModel):
    """Bounds on what one request may ask of the gateway beyond ``max_body_bytes`` (``gateway.pipeline.body``,
    ``gateway.slowclients``); each breach is a 400 naming the field, or a closed connection."""

    model_config = ConfigDict(extra="forbid")

    json_max_depth: int = Field(default=32, ge=2, le=256)
    json_max_integer_digits: int = Field(default=64, ge=20, le=4000)  # 20: every 64-bit integer
    json_max_string_length: int = Field(default=1024 * 1024, ge=1)  # characters
    json_max_array_length: int = Field(default=131_072, ge=1)
    json_max_object_keys: int = Field(default=1000, ge=1)
    stop_max_sequences: int = Field(default=16, ge=1, le=64)  # 64: the engine's MAX_STOP_STRINGS
    stop_max_bytes: int = Field(default=512, ge=1, le=64 * 1024)  # each, UTF-8
    # The schemas a request asks to be enforced (response_format's, each tool's parameters) and its
    # guided_regex / guided_choice, checked before the guardrails and the grammar engine see them
    # (gateway.pipeline.body); the totals count every schema of the request together.
    schema_max_bytes: int = Field(default=65_536, ge=1024)  # each schema, compact JSON
    schema_max_total_bytes: int = Field(default=524_288, ge=1024)
    schema_max_keywords: int = Field(default=10_000, ge=1)  # object keys, all schemas together
    schema_max_depth: int = Field(default=24, ge=2, le=256)  # nesting inside one schema
    schema_max_enum_values: int = Field(default=2_000, ge=1)  # all schemas together, and guided_choice
    schema_max_patterns: int = Field(default=128, ge=0)  # pattern / patternProperties regexes, all together
    schema_max_pattern_bytes: int = Field(default=4_096, ge=1)  # each regex, and guided_regex
    schema_max_bound: int = Field(default=100_000, ge=1)  # each minLength, maxLength, minItems, ...
    # Slow clients: a connection must deliver a request's headers this long after
    # it opens (or after the previous answer), and its body this long after the
    # headers; an idle keep-alive connection is closed after keep_alive_timeout.
    header_timeout_seconds: float = Field(default=10.0, gt=0, le=600)
    body_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    keep_alive_timeout_seconds: int = Field(default=5, ge=1, le=600)

    def stop_limits(self) -> StopLimits:
        return StopLimits(max_sequences=self.stop_max_sequences, max_bytes=self.stop_max_bytes)

    def schema_limits(self) -> SchemaLimits:
        return SchemaLimits(**{name: getattr(self, f"schema_{name}") for name in SchemaLimits.__dataclass_fields__})

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
