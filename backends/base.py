"""The backend seam: the engine owns bookkeeping, a backend owns tensors.

The engine hands a backend integer block tables and token ids; the backend hands
back logits. One multi-token ``forward`` per sequence is the single mechanism
behind prefill chunks, decode steps and (later) speculative verification.

This module imports no tensor library, so the gateway and the engine can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class ModelSpec:
    """What to load: a GGUF file or a Hugging Face safetensors directory."""

    name: str  # the id clients use in the "model" field
    path: str  # GGUF file or safetensors directory
    dtype: str = "auto"  # auto | float32 | bfloat16
    aliases: tuple[str, ...] = ()
    # A remote backend's model: where it is served from (the ``upstream`` settings, as plain data); path is "".
    upstream: Mapping[str, Any] | None = field(default=None, hash=False)
    # The load-time pass pipeline's settings (backends/cpu/pass_config.py PassConfig: quantise, gemm_from);
    # None: the engine's, else the backend's default.
    passes: Mapping[str, Any] | None = field(default=None, hash=False)
    # Batch-invariant kernels: a request's logits are the same bits alone, in any batch, after
    # preemption and under speculative verification (the cpu backend; others refuse it).
    deterministic: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about a loaded model."""

    name: str
    architecture: str
    vocab_size: int
    context_length: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the dtype actually in use: float32 | bfloat16
    hidden_size: int = 0  # the width of an embedding (``embed``); 0: unknown (an upstream's model)
    # What the load-time passes did (backends/cpu/pass_config.py PassRecord.as_dict), in order; () if none ran.
    passes: tuple[Mapping[str, Any], ...] = field(default=(), hash=False, compare=False)
    deterministic: bool = False  # batch-invariant kernels in use (ModelSpec.deterministic)


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's share of a forward step.

    ``token_ids`` are the new tokens to run at positions
    ``start_pos .. start_pos + len(token_ids) - 1``; the KV of positions
    ``0 .. start_pos - 1`` is already in the cache. ``block_table`` maps logical
    block ``i`` to a physical block and covers every position up to the last new
    token. ``num_logits`` asks for the logits of the last ``num_logits`` new
    tokens: 0 for a prefill chunk that is not the last, 1 for a decode step or
    the end of a prefill, ``len(token_ids)`` for speculative verification.
    """

    seq_id: int
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    num_logits: int = 1


@dataclass(frozen=True)
class Batch:
    slices: Sequence[SequenceSlice]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.slices)

    @property
    def num_logits(self) -> int:
        return sum(s.num_logits for s in self.slices)


@runtime_checkable
class Backend(Protocol):
    """A backend plugin, registered under the ``inferflux.backends`` entry point group."""

    name: ClassVar[str]
    # Optional: the KV block size (tokens) the engine uses when ``engine.block_size`` is unset
    # (``default_block_size``); without it, the engine's ``DEFAULT_BLOCK_SIZE``.
    # ``default_block_size: ClassVar[int]``

    @classmethod
    def probe(cls) -> str | None:
        """None if this machine can run the backend, otherwise the reason it cannot."""

    def load(self, spec: ModelSpec) -> ModelInfo:
        """Load weights; returns the model's shape."""

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes one KV block of ``block_size`` tokens takes across all layers."""

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Preallocate the paged KV cache."""

    def forward(self, batch: Batch) -> Any:
        """Run one step; returns float32 logits shaped ``[batch.num_logits, vocab]``,
        rows in slice order. The result must convert with ``numpy.asarray``."""

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy KV block ``src`` to ``dst`` for each pair (copy-on-write)."""

    # Optional, for preemption by swapping (EngineConfig.preemption_mode "swap"); an
    # engine configured to swap refuses to start on a backend without them:
    #
    # ``allocate_swap(self, num_slots: int, block_size: int, directory: str | None) -> None``
    #     Reserve ``num_slots`` swap slots of one KV block each: in host memory when
    #     ``directory`` is None, else in a file under ``directory`` (the disk tier).
    # ``swap_out(self, pairs: Sequence[tuple[int, int]]) -> None``
    #     Copy KV block ``block`` into swap slot ``slot`` for each ``(block, slot)``.
    #     When it returns the blocks may be overwritten; writing the slots to their
    #     final tier may finish later, off the step loop.
    # ``swap_in(self, pairs: Sequence[tuple[int, int]]) -> None``
    #     Copy swap slot ``slot`` back into KV block ``block`` for each ``(slot, block)``,
    #     after any write of that slot still under way.
    #
    # Optional, for embeddings (``POST /v1/embeddings``); without it a model answers
    # that it does not serve embeddings:
    #
    # ``embed(self, token_lists: Sequence[Sequence[int]], pooling: str) -> array``
    #     Run each list as a sequence of its own from position 0, neither reading nor
    #     writing the KV cache (the engine calls it between steps, while other
    #     sequences' KV lives in the cache), and pool each one's final hidden
    #     states (after the final norm): ``"mean"`` over its tokens or ``"last"``,
    #     its last token's. Returns float32 ``[len(token_lists), hidden_size]``,
    #     not normalised, convertible with ``numpy.asarray``.
    #
    # Optional: ``release_thread_pool(self) -> None``. The engine calls it on
    # the thread that loaded the model, just before its own thread takes over
    # every later call, so a backend can free worker threads that the loading
    # thread still holds (see CPUBackend.release_thread_pool).


# How ``embed`` pools a sequence's final hidden states into one vector.
POOLINGS = ("mean", "last")


def check_embed_args(loaded: bool, token_lists: Sequence[Sequence[int]], pooling: str) -> None:
    """What every backend's ``embed`` refuses with a ``BackendError``: no model, an unknown pooling, an empty list."""
    if not loaded:
        raise BackendError("embed called before load()")
    if pooling not in POOLINGS:
        raise BackendError(f"unknown pooling {pooling!r} (choose from {', '.join(POOLINGS)})")
    if not token_lists or not all(len(tokens) for tokens in token_lists):
        raise BackendError("embed needs at least one token list, none of them empty")


@runtime_checkable
class RemoteBackend(Protocol):
    """A backend plugin that serves whole requests from an engine of its own (``kind = "remote"``).

    Engine backends implement ``forward`` under our engine; a remote backend
    (the ``openai`` plugin: vLLM, SGLang, TGI, llama.cpp servers, other
    InferFlux nodes) opens an engine-shaped client that takes a whole request
    and streams its answer. Both register in ``inferflux.backends``; the gateway
    sees one generate-and-stream interface per served model.
    """

    name: ClassVar[str]
    kind: ClassVar[str]  # "remote"

    @classmethod
    def probe(cls) -> str | None:
        """None if this machine can run the backend, otherwise the reason it cannot."""

    def open(self, config: Any, *, upstream_model: str, max_model_len: int = 0) -> Any:
        """The served model's engine-shaped client (``make_request``/``stream``/``stats``/``shutdown``)."""


def serves_embeddings(backend: object) -> bool:
    """Whether ``backend`` has the optional ``embed`` (see ``Backend``): what a served model's card says."""
    return callable(getattr(backend, "embed", None))


def default_block_size(backend: object, fallback: int) -> int:
    """The KV block size ``backend`` asks for (its ``default_block_size``), else ``fallback``."""
    size = getattr(backend, "default_block_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else fallback


def backend_kind(cls: type) -> str:
    """``"engine"`` (runs ``forward`` under our engine) or ``"remote"`` (serves whole requests)."""
    kind = getattr(cls, "kind", "engine")
    return kind if kind in ("engine", "remote") else "engine"


def choose_dtype(name: str, backend: str, supported: Sequence[str], auto: Callable[[], str]) -> str:
    """``name`` if ``backend`` supports it, ``auto()`` for "auto" (which must be in ``supported``)."""
    if name not in supported:
        raise BackendError(f"unsupported dtype {name!r} for the {backend} backend (choose from {', '.join(supported)})")
    return auto() if name == "auto" else name


@dataclass
class BackendError(Exception):
    """A backend cannot do what was asked (not available, bad model file, ...)."""

    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message
