"""The settings as one object: the top-level keys, and the sections (``gateway.settings.sections``, ``.engine``,
``.upstreams``) under them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from inferflux.backends.base import ModelSpec
from inferflux.gateway.settings.engine import (
    EmbeddingSettings,
    EngineSettings,
    GrammarSettings,
    ModelEntry,
    RuntimeSettings,
    SpeculativeSettings,
)
from inferflux.gateway.settings.sections import (
    AuditSettings,
    AuthSettings,
    ByteSize,
    ConsoleSettings,
    WebSocketSettings,
    Dtype,
    InputLimitSettings,
    LogFormat,
    LogLevel,
    ManifestRegistrySettings,
    ModelRegistrySettings,
    RateLimitSettings,
    ServerSettings,
    TracingSettings,
)
from inferflux.gateway.settings.upstreams import UpstreamPolicySettings, UpstreamRefused
from inferflux.policy.store.config import StoreSettings

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


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
    log_format: LogFormat = "text"
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
    grammar: GrammarSettings = Field(default_factory=GrammarSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    models: list[ModelEntry] = Field(default_factory=list)
    model_registry: ModelRegistrySettings = Field(default_factory=ModelRegistrySettings)
    registry: ManifestRegistrySettings = Field(default_factory=ManifestRegistrySettings)  # manifest files
    store: StoreSettings = Field(default_factory=StoreSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    console: ConsoleSettings = Field(default_factory=ConsoleSettings)
    websocket: WebSocketSettings = Field(default_factory=WebSocketSettings)
    ratelimit: RateLimitSettings = Field(default_factory=RateLimitSettings)
    audit: AuditSettings = Field(default_factory=AuditSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)
    upstreams: UpstreamPolicySettings = Field(default_factory=UpstreamPolicySettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)

    @field_validator("data_dir", mode="before")
    @classmethod
    def _expand(cls, value: Any) -> Any:
        return Path(value).expanduser() if isinstance(value, str | Path) else value

    @field_validator("log_level", "log_format", mode="before")
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

    @model_validator(mode="after")
    def _upstream_rules(self) -> Settings:
        """Each model's upstream under the ``upstreams`` section's rules (``gateway.settings.upstreams``)."""
        egress = None
        for position, entry in enumerate(self.models):
            if entry.upstream is not None:
                egress = egress or self.upstreams.egress(self.host, self.port)
                try:
                    self.upstreams.check(entry.upstream, egress, self.secret_variables())
                except UpstreamRefused as exc:
                    raise ValueError(f"models[{position}].upstream.{exc}") from None
        return self

    def secret_variables(self) -> frozenset[str]:
        """The environment variables this configuration reads secrets from (besides the gateway's fixed ones)."""
        return frozenset(sink.token_env for sink in self.audit.sinks if sink.token_env)

    def _passes(self, entry: ModelEntry) -> dict[str, Any] | None:
        """A model's load passes: the engine section's, each key its entry sets overriding."""
        merged = {**(self.engine.passes.model_dump(exclude_none=True) if self.engine.passes else {}),
                  **(entry.passes.model_dump(exclude_none=True) if entry.passes else {})}
        return merged or None

    def model_specs(self) -> list[tuple[ModelSpec, str]]:
        """Each model to serve with its backend name; the default SmolLM2 if none is configured."""
        entries = self.models or [ModelEntry(name=DEFAULT_MODEL_NAME, path=default_model_path(), aliases=["smollm2"])]
        return [self.model_spec(e) for e in entries]

    def model_spec(self, e: ModelEntry) -> tuple[ModelSpec, str]:
        """One ``models:`` entry (or a manifest, which has its schema) as a spec under these settings' defaults,
        with its backend name."""
        spec = ModelSpec(
            name=e.name,
            path=e.path or "",
            dtype=e.dtype or self.dtype,
            aliases=tuple(e.aliases),
            upstream=None if e.upstream is None else e.upstream.model_dump(),
            passes=self._passes(e),
            deterministic=e.upstream is None and (self.engine.deterministic if e.deterministic is None else e.deterministic),
        )
        return spec, e.backend or self.backend

    def model_speculative(self, name: str) -> SpeculativeSettings | None:
        """The ``speculative`` section of the configured model ``name`` (None: it sets none)."""
        return next((e.speculative for e in self.models if e.name == name), None)

    def model_embedding(self, name: str) -> EmbeddingSettings:
        """How the model ``name`` embeds: its ``embedding`` section, else the defaults (also for
        models loaded through the admin API, which have no section)."""
        return next((e.embedding for e in self.models if e.name == name and e.embedding is not None),
                    EmbeddingSettings())  # fmt: skip


def default_model_path() -> str:
    """The default SmolLM2's GGUF file (imported on use: settings load without the model package)."""
    from inferflux.backends.models import default_model_path as packaged

    return packaged()
