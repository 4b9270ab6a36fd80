"""The settings' sections of the inference side: the models served, the engine that runs them, the grammars
a request may build, and the chain ``backend: auto`` walks.

Each maps onto the component that reads it (named in its docstring); the value
types they share (``ByteSize``, ``Dtype``) and the gateway's own sections are
in ``gateway.settings.sections``, the upstream sections in
``gateway.settings.upstreams``. The whole file's reference, with every key, is
the package docstring (``gateway.settings``).
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from inferflux.gateway.settings.sections import ByteSize, Dtype
from inferflux.gateway.settings.upstreams import UpstreamSettings


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
    # Token ids as ``input`` are read as this model's own ids. Clients send other tokenizers'
    # (LangChain's OpenAIEmbeddings sends OpenAI's by default), which would embed other text
    # without an error; so they are refused (400) unless the operator says the clients' ids are this model's.
    token_ids: bool = False


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


def _split_names(value: Any) -> Any:
    """``"cuda, cpu"`` (an environment variable) -> ``["cuda", "cpu"]``; lists pass through."""
    return [item.strip() for item in value.split(",") if item.strip()] if isinstance(value, str) else value


def _isa_name(value: Any) -> Any:
    """A level's name as written in a file or the environment (`` AVX2 ``, ``native``) as the one it means."""
    if not isinstance(value, str):
        return value
    name = value.strip().lower()
    return "auto" if name == "native" else name


class RuntimeSettings(BaseModel):
    """Which backend ``backend: auto`` picks (``backends.registry``), and the CPU kernels' instruction set."""

    model_config = ConfigDict(extra="forbid")

    # Tried in order; the first allowed backend whose probe passes serves. Unset:
    # the registry's default chain (cuda, metal, then cpu before mlx-on-Linux).
    backend_priority: Annotated[list[str] | None, BeforeValidator(_split_names)] = None
    # The level the CPU kernels are built for (kernels/cpu/__init__.py): auto, this machine's own, or one
    # pinned below it (docs/architecture.md). Unset: INFERFLUX_CPU_ISA, then auto. ``native`` is auto's old name.
    cpu_isa: Annotated[Literal["auto", "avx512", "avx2", "generic"] | None, BeforeValidator(_isa_name)] = None

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
