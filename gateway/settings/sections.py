"""The settings' sections: one pydantic model per YAML section, and the value types they share.

Each section maps onto the component that reads it (named in its docstring),
so a new knob goes beside its section's siblings and the component's default.
The whole file's reference, with every key, is the package docstring
(``gateway.settings``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from inferflux.gateway.pipeline.body import JsonLimits, SchemaLimits
from inferflux.gateway.pipeline.sampling import StopLimits
# The upstream sections have a module of their own; ModelEntry and Settings take them from here.
from inferflux.gateway.settings.upstreams import UpstreamPolicySettings, UpstreamSettings  # noqa: F401

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


REMOTE_BACKEND = "openai"


class EmbeddingSettings(BaseModel):
    """How a local model answers ``POST /v1/embeddings`` (``gateway.pipeline.embeddings``)."""

    model_config = ConfigDict(extra="forbid")

    # The final hidden states (after the final norm) pooled over the input: their mean,
    # or the last token's (for models trained to embed that way: e5-mistral, gte-Qwen2,
    # Qwen3-Embedding). A generative model is not trained for either; the mean is the
    # steadier of the two for it, so it is the default.
    pooling: Literal["mean", "last"] = "mean"
    normalize: bool = True  # unit L2 norm, as OpenAI's embeddings have
    # The model was trained so that the first N components of its vectors are an
    # embedding of their own (Matryoshka representation learning): a request's
    # ``dimensions`` may then shorten them. Off, ``dimensions`` may only name the full size.
    matryoshka: bool = False


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    path: str | None = Field(default=None, min_length=1)  # a local model's file or directory
    backend: str | None = None
    dtype: Dtype | None = None
    aliases: list[str] = Field(default_factory=list)
    # This model's load passes (quantisation), over the engine section's; unset: the engine's.
    passes: PassesSettings | None = None
    # Batch-invariant kernels (docs/backends.md#deterministic-mode); unset: engine.deterministic.
    deterministic: bool | None = None
    # This model's speculative decoding; unset: the engine section's (off by default).
    speculative: SpeculativeSettings | None = None
    # A model served by upstream servers (backend "openai") instead of weights here.
    upstream: UpstreamSettings | None = None
    # How this model answers /v1/embeddings; unset: EmbeddingSettings' defaults.
    embedding: EmbeddingSettings | None = None

    @model_validator(mode="after")
    def _local_or_remote(self) -> ModelEntry:
        if self.upstream is None:
            if self.path is None:
                raise ValueError("a model needs a path (its weights here) or an upstream (servers elsewhere)")
            if self.backend == REMOTE_BACKEND:
                raise ValueError(f"backend {REMOTE_BACKEND!r} needs an upstream section")
            return self
        if self.path is not None:
            raise ValueError("give a model a path or an upstream, not both")
        if self.backend not in (None, REMOTE_BACKEND):
            raise ValueError(f"a model with an upstream is served by backend {REMOTE_BACKEND!r}")
        if self.speculative is not None or self.dtype is not None or self.passes is not None:
            raise ValueError("speculative, dtype and passes apply to local models; an upstream decides its own")
        if self.deterministic is not None:
            raise ValueError("deterministic applies to local models; an upstream decides its own kernels")
        if self.embedding is not None:
            raise ValueError("embedding applies to local models; an upstream pools its own embeddings")
        self.backend = REMOTE_BACKEND
        return self


class PassesSettings(BaseModel):
    """The CPU backend's load-time passes (backends/cpu/passes.py; docs/backends.md): the weights'
    format (auto: the file's own blocks where the C++ kernels run and the file is quantised, else
    dense), the rows from which a quantised projection uses the GEMM path, whether bfloat16
    dense weights are packed once for oneDNN (unset: yes; a copy beside each weight), and whether
    decode steps run every layer in one C++ call where that gives the same bits (unset: yes)."""

    model_config = ConfigDict(extra="forbid")

    quantise: Literal["auto", "blocks", "native", "hybrid", "exact", "int8", "int4", "bf16", "f32"] | None = None
    gemm_from: int | None = Field(default=None, ge=1, le=1 << 20)
    pack: bool | None = None
    decode_loop: bool | None = None


class EngineSettings(BaseModel):
    """Maps onto ``backends.engine.EngineConfig``; unset keys keep the engine's defaults."""

    model_config = ConfigDict(extra="forbid")

    kv_cache_bytes: ByteSize | None = None
    block_size: int | None = Field(default=None, gt=0)
    max_num_seqs: int | None = Field(default=None, gt=0)
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    max_model_len: int | None = Field(default=None, gt=0)
    enable_prefix_caching: bool | None = None  # engine default: on
    # Compiled grammars kept per model, by estimated bytes (and at most 256 of them); engine default: 256MiB.
    grammar_cache_bytes: ByteSize | None = None
    speculative: SpeculativeSettings | None = None  # every model's, unless its entry sets its own; unset: off
    passes: PassesSettings | None = None  # every local model's load passes, under each entry's own
    # Batch-invariant kernels for every local model whose entry does not say (docs/backends.md#deterministic-mode):
    # a request's logits are the same bits alone or batched with others'. Off by default: it costs throughput.
    deterministic: bool = False
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


class GrammarSettings(BaseModel):
    """What building one grammar may cost (``backends.engine.grammar_sandbox``): a response_format schema, a
    forced tool call, a guided regex or choice, a tool's parameters. A grammar the process has not built
    before is built in a worker process first, killed at the first bound it passes (400 schema_too_complex);
    ``workers`` of them at once, a request waiting at most ``queue_seconds`` for one (then 503 grammar_busy),
    the tenant holding the fewest getting the next free one."""

    model_config = ConfigDict(extra="forbid")

    workers: int = Field(default=2, ge=1, le=64)
    cpu_seconds: float = Field(default=1.0, gt=0, le=600)  # its compile and first mask, CPU time
    wall_seconds: float = Field(default=5.0, gt=0, le=3600)  # the same, wall time (a busy host stretches it)
    memory_bytes: ByteSize = Field(default=512 * 1024 * 1024, ge=16 * 1024 * 1024)  # above the worker's baseline
    queue_seconds: float = Field(default=30.0, ge=0, le=600)

    def budget(self) -> Any:
        """The ``GrammarBudget`` these settings give each grammar."""
        from inferflux.backends.engine import GrammarBudget

        return GrammarBudget(cpu_seconds=self.cpu_seconds, wall_seconds=self.wall_seconds,
                             memory_bytes=self.memory_bytes, queue_seconds=self.queue_seconds)  # fmt: skip


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
        from inferflux.backends.base import BackendError
        from inferflux.backends.registry import parse_names

        try:
            return list(parse_names(names, "backend_priority"))
        except BackendError as exc:
            raise ValueError(str(exc)) from None
