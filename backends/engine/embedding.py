"""Embeddings in the engine: a request checked once, then run in batches between generation steps.

An ``EmbeddingRequest`` is made by ``LLMEngine.make_embedding_request`` (from
any thread), as an ``EngineRequest`` is by ``make_request``: each input's
token ids are checked against the vocabulary and the context there, and the
engine trusts the record from then on. ``AsyncEngine.embed`` hands it to the
engine thread, the only thread that calls the backend, which takes one batch
from its ``EmbeddingQueue`` before each generation step: at most
``max_num_batched_tokens`` tokens (the budget a step has), first come first
served, so a request of many inputs holds running generations back by one
such batch at a time, not by all of it. An input longer than the budget runs
alone. The backend's ``embed`` runs the inputs as fresh sequences without a
KV cache, so the paged cache of the sequences being generated is untouched.

The pooled rows are finished here, in numpy: cut to ``dimensions`` (a model
trained for it; the gateway decides which) and L2-normalised when asked.
``EngineEmbeddings`` holds ``LLMEngine``'s embedding methods (it inherits
them): the check of a request and the backend's ``embed`` call.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inferflux.backends.base import POOLINGS, Backend, BackendError, ModelInfo, serves_embeddings

from .errors import EmbeddingsUnsupportedError, InputTooLongError, InvalidRequestError

# Below this a vector's norm is taken as zero: it is returned as it is, not divided by ~0.
_MIN_NORM = 1e-12


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    request_id: str
    inputs: tuple[tuple[int, ...], ...]  # each input's token ids, checked
    pooling: str  # backends.base.POOLINGS
    normalize: bool = True  # L2-normalise each vector (after cutting it to ``dimensions``)
    dimensions: int | None = None  # keep the first this many components; None: all of them
    tenant: str | None = None  # whose request (the queue counts each tenant's waiting requests)
    engine_id: int = 0  # id() of the engine that checked it

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.inputs)


@dataclass(frozen=True)
class EmbeddingResult:
    vectors: np.ndarray  # float32 [len(inputs), dimensions or the model's hidden size], in input order
    prompt_tokens: int  # what the inputs cost: their tokens, all counted


def finish(pooled: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Pooled rows as returned: their first ``dimensions`` components, L2-normalised if ``normalize``."""
    vectors = np.asarray(pooled, dtype=np.float32)
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.where(norms > _MIN_NORM, norms, 1.0)
    return np.ascontiguousarray(vectors, dtype=np.float32)


@dataclass(eq=False)
class EmbeddingJob:
    """One request in the queue: its inputs run so far, and where its result goes (the owner's ``stream``)."""

    request: EmbeddingRequest
    stream: Any = None
    rows: list[np.ndarray | None] = field(default_factory=list)
    next_input: int = 0
    # Set from another thread when the caller stops waiting: the engine thread
    # then drops the job before its next batch (one batch already running finishes).
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.rows = [None] * len(self.request.inputs)


@dataclass
class EmbeddingBatch:
    """The inputs of one ``embed`` call: (job, input index) in order, all of one pooling."""

    pooling: str
    parts: list[tuple[EmbeddingJob, int]]

    @property
    def token_lists(self) -> list[Sequence[int]]:
        return [job.request.inputs[i] for job, i in self.parts]

    @property
    def jobs(self) -> list[EmbeddingJob]:
        return list(dict.fromkeys(job for job, _ in self.parts))


class EmbeddingQueue:
    """The engine thread's waiting embedding jobs, taken in batches of at most ``budget`` tokens.

    Only the engine thread touches it (``AsyncEngine``), or one caller at a
    time (``LLMEngine.embed_request``).
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._jobs: deque[EmbeddingJob] = deque()

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[EmbeddingJob]:
        return iter(self._jobs)

    def add(self, job: EmbeddingJob) -> None:
        self._jobs.append(job)

    def waiting_per_tenant(self) -> dict[str | None, int]:
        counts: dict[str | None, int] = {}
        for job in self._jobs:
            counts[job.request.tenant] = counts.get(job.request.tenant, 0) + 1
        return counts

    def next_batch(self) -> EmbeddingBatch | None:
        """The next inputs to run, oldest first; None when only cancelled jobs were left (they are dropped)."""
        while self._jobs and self._jobs[0].cancelled:
            self._jobs.popleft()
        if not self._jobs:
            return None
        pooling = self._jobs[0].request.pooling
        parts: list[tuple[EmbeddingJob, int]] = []
        tokens = 0
        for job in self._jobs:
            if job.cancelled:
                continue
            if job.request.pooling != pooling:
                break
            for i in range(job.next_input, len(job.request.inputs)):
                size = len(job.request.inputs[i])
                if parts and tokens + size > self.budget:
                    return EmbeddingBatch(pooling, parts)
                parts.append((job, i))
                tokens += size
        return EmbeddingBatch(pooling, parts)

    def deliver(self, batch: EmbeddingBatch, pooled: np.ndarray) -> list[tuple[EmbeddingJob, EmbeddingResult]]:
        """Record the batch's pooled rows; the jobs it completed, each with its result (and out of the queue)."""
        for (job, i), row in zip(batch.parts, pooled, strict=True):
            job.rows[i] = row
            job.next_input = i + 1
        done = []
        for job in batch.jobs:
            if job.next_input == len(job.request.inputs):
                request = job.request
                vectors = finish(np.stack(job.rows), request.dimensions, request.normalize)  # type: ignore[arg-type]
                done.append((job, EmbeddingResult(vectors, request.num_tokens)))
                self._remove(job)
        return done

    def drop(self, jobs: Sequence[EmbeddingJob]) -> None:
        """Take ``jobs`` out of the queue (failed ones: their callers are told by the owner)."""
        for job in jobs:
            self._remove(job)

    def clear(self) -> list[EmbeddingJob]:
        jobs, self._jobs = list(self._jobs), deque()
        return jobs

    def _remove(self, job: EmbeddingJob) -> None:
        try:
            self._jobs.remove(job)
        except ValueError:
            pass


class EngineEmbeddings:
    """``LLMEngine``'s embedding methods: it inherits them, and owns the attributes declared here."""

    backend: Backend
    model_info: ModelInfo
    vocab_size: int
    max_model_len: int
    num_tokens_embedded: int
    config: Any  # EngineConfig: its max_num_batched_tokens is a batch's budget

    @property
    def supports_embeddings(self) -> bool:
        """Whether the backend has the optional ``embed`` (backends.base)."""
        return serves_embeddings(self.backend)

    def make_embedding_request(
        self,
        request_id: str,
        inputs: Iterable[Iterable[int]],
        pooling: str,
        *,
        normalize: bool = True,
        dimensions: int | None = None,
        tenant: str | None = None,
    ) -> EmbeddingRequest:
        """Check an embedding request against the model, as ``make_request`` does a generation's. Thread-safe.

        Each input is a non-empty list of token ids in the vocabulary, at most
        the context long (no room for output is needed). Errors name the
        input as ``input[i]``. Raises ``EmbeddingsUnsupportedError`` when the
        backend has no ``embed``.
        """
        if not self.supports_embeddings:
            raise EmbeddingsUnsupportedError(getattr(self.backend, "name", type(self.backend).__name__))
        if pooling not in POOLINGS:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}", param="pooling")
        hidden = self.model_info.hidden_size
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or not 1 <= dimensions <= (hidden or dimensions)):  # fmt: skip
            raise InvalidRequestError(f"dimensions must be from 1 to {hidden}, got {dimensions!r}", param="dimensions")
        checked = [self._checked_input(f"input[{i}]", tokens) for i, tokens in enumerate(inputs)]
        if not checked:
            raise InvalidRequestError("at least one input is required", param="input")
        return EmbeddingRequest(request_id, tuple(checked), pooling, normalize=bool(normalize), dimensions=dimensions,
                                tenant=tenant, engine_id=id(self))  # fmt: skip

    def _checked_input(self, name: str, tokens: Iterable[int]) -> tuple[int, ...]:
        try:
            ids = tuple(operator.index(t) for t in tokens)
        except TypeError:
            raise InvalidRequestError(f"{name}: token ids must be integers", param=name) from None
        if not ids:
            raise InvalidRequestError(f"{name} is empty; at least one token is required", param=name)
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise InvalidRequestError(f"{name}: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})",
                                      param=name)  # fmt: skip
        if len(ids) > self.max_model_len:
            raise InputTooLongError(name, len(ids), self.max_model_len)
        return ids

    def embed(self, token_lists: Sequence[Sequence[int]], pooling: str) -> np.ndarray:
        """One ``embed`` call on the backend: float32 ``[len(token_lists), hidden]``, pooled, not normalised."""
        pooled = np.asarray(self.backend.embed(token_lists, pooling), dtype=np.float32)  # type: ignore[attr-defined]
        if pooled.ndim != 2 or pooled.shape[0] != len(token_lists):
            raise BackendError(f"embed returned shape {pooled.shape} for {len(token_lists)} inputs")
        self.num_tokens_embedded += sum(len(t) for t in token_lists)
        return pooled

    def embed_request(self, request: EmbeddingRequest) -> EmbeddingResult:
        """Run a checked embedding request to the end on the calling thread (the engine's owner), in the
        batches the engine thread would use; ``AsyncEngine.embed`` interleaves them with generation."""
        if request.engine_id != id(self):
            raise InvalidRequestError("the request was checked by another engine", param=None)
        queue = EmbeddingQueue(self.config.max_num_batched_tokens)
        queue.add(EmbeddingJob(request))
        while (batch := queue.next_batch()) is not None:
            for _, result in queue.deliver(batch, self.embed(batch.token_lists, batch.pooling)):
                return result
        raise RuntimeError("the embedding queue ended without a result")  # an engine bug, not the client's
