"""A model load asked of the admin API: the request checked, and the load's progress while it runs.

``checked_load`` holds a request to the rules a configuration file's
``models[]`` entry is held to (``gateway.settings.engine.ModelEntry``), so a
mistake is a 422 naming the field now, not a failed load later: a local model
needs weights this server can read and a backend it can use; a model with an
``upstream`` takes neither path, dtype, embedding, deterministic nor passes,
and its section passes the ``upstreams`` rules (``gateway.models.upstreams``).
The ``ModelLoad`` it returns is what ``ModelAdmin.describe`` shows until the
model is served: its stage and elapsed time, and its error if it failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferflux.backends.cpu.pass_config import DENSE_DTYPES  # loads no torch
from inferflux.backends.openai.egress import EgressPolicy
from inferflux.gateway.auth import call_store
from inferflux.gateway.models.upstreams import check_key_source, checked_upstream, describe_upstream
from inferflux.gateway.settings import Settings
from inferflux.gateway.settings.engine import REMOTE_BACKEND
from inferflux.policy.errors import ValidationFailed
from inferflux.policy.store import PolicyStore

@dataclass
class ModelLoad:
    name: str
    path: str
    backend: str
    dtype: str
    aliases: tuple[str, ...]
    default: bool
    upstream: dict[str, Any] | None = None  # a remote backend's model: where it is served from
    embedding: dict[str, Any] | None = None  # a local model's embedding section (None: the defaults)
    deterministic: bool = False  # batch-invariant kernels (ModelSpec.deterministic)
    passes: dict[str, Any] | None = None  # the load passes asked for (ModelSpec.passes); None: the backend's
    # From the store's registry (a convergence), not from this replica's admin API.
    stored: bool = False
    # A failed load from the registry is tried again only past this policy_version.
    version: int | None = None
    status: str = "loading"  # loading | failed
    stage: str = "queued"
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None

    def describe(self) -> dict[str, Any]:
        end = self.finished if self.finished is not None else time.monotonic()
        return {
            "object": "model",
            "id": self.name,
            "status": self.status,
            "stage": self.stage,
            "error": self.error,
            "elapsed_seconds": round(end - self.started, 2),
            "path": self.path,
            "backend": self.backend,
            "dtype": self.dtype,
            "aliases": list(self.aliases),
            "source": "admin",
            "deterministic": self.deterministic,
            # What was asked for; once loaded, GET shows what ran ("passes": the records).
            **({"passes_requested": dict(self.passes)} if self.passes else {}),
            **({"upstream": describe_upstream(self.upstream)} if self.upstream is not None else {}),
            **({"embedding": self.embedding} if self.embedding is not None else {}),
        }


async def checked_load(
    settings: Settings,
    store: PolicyStore,
    egress: EgressPolicy,
    *,
    name: str,
    path: str | None,
    backend: str | None,
    dtype: str | None,
    aliases: tuple[str, ...],
    default: bool,
    upstream: dict[str, Any] | None,
    embedding: dict[str, Any] | None,
    deterministic: bool | None,
    passes: dict[str, Any] | None,
) -> ModelLoad:
    """The load asked for, every argument checked (``ValidationFailed`` naming the first wrong one)."""
    if upstream is not None:
        _refuse_local_keys(path, backend, dtype, embedding, deterministic, passes)
        upstream = checked_upstream(settings, upstream, egress)
        await call_store(check_key_source, store, upstream)
        backend, path, dtype = REMOTE_BACKEND, "", "upstream"
    elif path is None:
        raise ValidationFailed("a model needs a path (its weights here) or an upstream (servers elsewhere)",
                               param="path")  # fmt: skip
    else:
        check_path(path)
        backend = backend or settings.backend
        if backend == REMOTE_BACKEND:
            raise ValidationFailed(f"backend '{REMOTE_BACKEND}' needs an upstream", param="upstream")
    check_backend(backend, settings)
    if upstream is None and deterministic is None:
        deterministic = settings.engine.deterministic
    dtype = dtype or settings.dtype
    if upstream is None:
        passes = merged_passes(settings, passes, dtype)
    return ModelLoad(name, path, backend, dtype, aliases, default, upstream, embedding, bool(deterministic), passes)


def _refuse_local_keys(path: str | None, backend: str | None, dtype: str | None, embedding: dict[str, Any] | None,
                       deterministic: bool | None, passes: dict[str, Any] | None) -> None:  # fmt: skip
    """A model with an upstream names none of a local model's keys (as the configuration file's ModelEntry)."""
    if embedding is not None:
        raise ValidationFailed("embedding applies to local models; an upstream pools its own embeddings",
                               param="embedding")  # fmt: skip
    if deterministic is not None:
        raise ValidationFailed("deterministic applies to local models; an upstream decides its own kernels",
                               param="deterministic")  # fmt: skip
    if passes is not None:
        raise ValidationFailed("passes apply to local models; an upstream decides its own weights", param="passes")
    if path is not None or dtype is not None:
        raise ValidationFailed("a model with an upstream takes neither path nor dtype", param="path")
    if backend not in (None, REMOTE_BACKEND):
        raise ValidationFailed(f"a model with an upstream is served by backend '{REMOTE_BACKEND}'", param="backend")


def check_path(path: str) -> None:
    """``path`` is a .gguf file or a directory with config.json on this server, else ``ValidationFailed``."""
    p = Path(path)
    try:
        if p.is_file() and p.suffix.lower() == ".gguf":
            return
        if p.is_dir() and (p / "config.json").is_file():
            return
    except OSError:  # a name too long, a directory we may not read: not a model we can load
        pass
    raise ValidationFailed(
        f"'{path}' is neither a .gguf file nor a directory with config.json on this server", param="path"
    )


def check_backend(name: str, settings: Settings) -> None:
    """Backend ``name`` can serve here (its probe passes, the priority chain allows it), else ``ValidationFailed``."""
    from inferflux.backends.registry import probe

    status = probe(name, priority=settings.runtime.backend_priority)
    if not status.available:
        raise ValidationFailed(f"backend '{name}' cannot be used: {status.reason}", param="backend")


def merged_passes(settings: Settings, passes: dict[str, Any] | None, dtype: str) -> dict[str, Any] | None:
    """engine.passes under the load's own, as the settings merge a model entry's (schema._passes); the
    registry keeps the result, so every replica loads with the same passes whatever its own engine section."""
    engine = settings.engine.passes
    merged = {**(engine.model_dump(exclude_none=True) if engine else {}), **(passes or {})}
    # quantise bf16/f32 names the load dtype: an explicit other one is refused now, not at load.
    wanted = DENSE_DTYPES.get(merged.get("quantise", ""))
    if wanted is not None and dtype not in ("auto", wanted):
        raise ValidationFailed(f"passes.quantise {merged['quantise']} contradicts dtype {dtype}", param="passes")
    return merged or None
