"""Served models: what the routes dispatch to, and how they are loaded."""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inferflux.backends.base import ModelInfo, ModelSpec

from inferflux.gateway import VERSION
from inferflux.gateway.errors import ModelNotFound

if TYPE_CHECKING:  # the engine is only needed at load time
    from inferflux.backends.engine import AsyncEngine, EngineConfig
    from inferflux.backends.engine.speculative import SpeculativeConfig
    from inferflux.backends.models import Tokenizer
    from inferflux.backends.openai.egress import EgressPolicy

    from inferflux.gateway.settings import EngineSettings, SpeculativeSettings

log = logging.getLogger("inferflux.gateway.models.served")


@dataclass(eq=False)
class ServedModel:
    """A model the routes dispatch to: weights run by our engine here, or (``remote``) an upstream fleet.

    Both kinds have an engine-shaped ``engine`` (``make_request``/``stream``/
    ``stats``/``shutdown``); only a local model has a tokenizer. What the routes
    need to know of the engine beyond that is stated here when it is started
    (``load_served_model``), never read back out of the engine.
    """

    name: str
    aliases: tuple[str, ...]
    tokenizer: Tokenizer | None
    info: ModelInfo
    engine: Any  # AsyncEngine, or backends.openai.RemoteEngine for a remote model
    backend: str = "unknown"
    created: int = field(default_factory=lambda: int(time.time()))
    remote: bool = False
    upstream: Mapping[str, Any] | None = None  # a remote model's upstream section (names its key, never holds it)
    # A model loaded through the admin API: its ``embedding`` section as loaded (None: the configuration's, or
    # the defaults; gateway.pipeline.embeddings.embedding_settings reads both).
    embedding: Mapping[str, Any] | None = None
    # A local model's speculative decoding, as its engine was started with it (None: none, or remote).
    speculative: SpeculativeConfig | None = None
    # A local model's backend computes embeddings (its optional ``embed``: backends.base.serves_embeddings).
    embeds: bool = False

    @property
    def local_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RuntimeError(f"the model {self.name!r} is served by an upstream and has no tokenizer here")
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        """The usable context: the engine may be configured below the model's own (0: an upstream's, unknown)."""
        return self.engine.stats().max_model_len

    @property
    def capabilities(self) -> list[str]:
        """What the model serves, by route: ``chat``, ``completions``, ``embeddings`` (a model without a chat
        template is rendered as ChatML; an upstream's model is forwarded all three)."""
        if self.remote:
            return ["chat", "completions", "embeddings"]
        return ["chat", "completions"] + (["embeddings"] if self.embeds else [])

    @functools.cached_property
    def system_fingerprint(self) -> str:
        """Changes whenever what produces the tokens changes (weights, backend, dtype); made once, since
        every streamed chunk carries it and none of those change while the model is served."""
        raw = "|".join((VERSION, self.name, self.info.architecture, self.backend, self.info.dtype))
        return "fp_" + hashlib.sha256(raw.encode()).hexdigest()[:10]

    def shutdown(self) -> None:
        self.engine.shutdown()


class ModelManager:
    """The served models by name and alias.

    ``expected`` names the models the configuration asks for; readiness means
    every one of them has been added.
    """

    def __init__(self, expected: Iterable[str] = ()) -> None:
        self._models: dict[str, ServedModel] = {}
        self._lookup: dict[str, ServedModel] = {}
        self._expected: list[str] = list(expected)
        self._default: str | None = None
        self._loading: set[str] = set()

    def add(self, model: ServedModel, *, default: bool = False) -> None:
        for key in (model.name, *model.aliases):
            if key in self._lookup:
                raise ValueError(f"model name or alias {key!r} is already served")
        self._models[model.name] = model
        for key in (model.name, *model.aliases):
            self._lookup[key] = model
        if default or self._default is None:
            self._default = model.name

    def get(self, name: str) -> ServedModel:
        try:
            return self._lookup[name]
        except KeyError:
            raise ModelNotFound(name) from None

    def list(self) -> list[ServedModel]:
        return list(self._models.values())

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(list(self._models.values()))

    def __len__(self) -> int:
        return len(self._models)

    def remove(self, name: str) -> ServedModel:
        """Stop serving ``name`` (canonical name); the caller shuts its engine down."""
        model = self._models.pop(name, None)
        if model is None:
            raise ModelNotFound(name)
        for key in (model.name, *model.aliases):
            self._lookup.pop(key, None)
        if name in self._expected:
            self._expected.remove(name)
        if self._default == name:
            self._default = next(iter(self._models), None)
        return model

    def replace(self, model: ServedModel) -> ServedModel:
        """Serve ``model`` in place of the model of its name in one step (a reload: no request finds neither);
        returns the old one, which the caller drains and shuts down. Its aliases may be the old one's."""
        old = self._models.get(model.name)
        if old is None:
            raise ModelNotFound(model.name)
        for key in (model.name, *model.aliases):
            if self._lookup.get(key, old) is not old:
                raise ValueError(f"model name or alias {key!r} is already served")
        for key in (old.name, *old.aliases):
            self._lookup.pop(key, None)
        self._models[model.name] = model
        for key in (model.name, *model.aliases):
            self._lookup[key] = model
        return old

    def set_default(self, name: str) -> None:
        self._default = self.get(name).name

    @property
    def default_name(self) -> str | None:
        return self._default

    def loading(self) -> list[str]:
        """Names being loaded in the background (see ``gateway.models.admin``)."""
        return list(self._loading)

    def mark_loading(self, name: str, loading: bool) -> None:
        if loading:
            self._loading.add(name)
        else:
            self._loading.discard(name)

    @property
    def default(self) -> ServedModel:
        if self._default is None:
            raise ModelNotFound("(default)")
        return self._models[self._default]

    def missing(self) -> list[str]:
        """Configured models that are not (yet) loaded."""
        return [name for name in self._expected if name not in self._models]

    def shutdown(self) -> None:
        for model in self._models.values():
            try:
                model.shutdown()
            except Exception:  # one engine failing to stop must not keep the others running
                log.exception("shutting down model %s failed", model.name)


def engine_config_from(engine: EngineSettings, speculative: SpeculativeSettings | None = None) -> EngineConfig:
    """The engine's configuration from the ``engine`` settings (and a model's own ``speculative``
    section, which wins over the engine's); unset keys keep the engine's defaults."""
    from inferflux.backends.engine import EngineConfig
    from inferflux.backends.engine.speculative import SpeculativeConfig

    # Applied per request by the routes / below; deterministic and passes reach the backend through ModelSpec.
    gateway_only = {"prefix_cache_per_tenant", "speculative", "deterministic", "passes"}
    kwargs = {k: v for k, v in engine.model_dump().items() if v is not None and k not in gateway_only}
    chosen = speculative or engine.speculative
    if chosen is not None:
        kwargs["speculative"] = SpeculativeConfig(**chosen.model_dump())
    return EngineConfig(**kwargs)


def load_draft_model(backend_cls: Any, spec: ModelSpec, path: str, target: ModelInfo) -> Any:
    """The draft model for ``spec``'s speculative decoding, on the target's backend kind.

    Its tokens are the target's token ids, so it must share the vocabulary.
    """
    from inferflux.backends.base import BackendError

    draft = backend_cls()
    info = draft.load(ModelSpec(name=f"{spec.name}-draft", path=path, dtype=spec.dtype))
    if info.vocab_size != target.vocab_size:
        raise BackendError(
            f"draft model {path} has a vocabulary of {info.vocab_size} tokens, the model {target.vocab_size}: "
            "a draft model must share the model's vocabulary"
        )
    return draft


def load_served_model(
    spec: ModelSpec,
    backend: str,
    engine_config: EngineConfig | None = None,
    on_stage: Callable[[str], None] | None = None,
    priority: Sequence[str] | None = None,
    upstream_key: str | None = None,
    egress: EgressPolicy | None = None,
) -> ServedModel:
    """Load ``spec`` on the named backend and start its engine.

    ``backend`` "auto" takes the first available backend of ``priority``
    (``runtime.backend_priority``; None: the registry's chain); the served
    model records the backend actually chosen.
    ``on_stage`` is told each stage as it starts (for load progress).
    A spec with an ``upstream`` opens a remote backend's client instead, which
    presents ``upstream_key`` (resolved by ``gateway.models.upstreams``) upstream, and
    connects only where ``egress`` allows (``gateway.models.upstreams.egress_policy``;
    None: the strictest rules, public addresses only).
    Raises ``BackendError`` (from the registry or the backend) when the backend
    is unavailable or the model cannot be loaded.
    """
    from inferflux.backends.base import BackendError, backend_kind
    from inferflux.backends.registry import resolve

    backend, backend_cls = resolve(backend, priority=priority)
    if backend_kind(backend_cls) == "remote" or spec.upstream is not None:
        if backend_kind(backend_cls) != "remote" or spec.upstream is None:
            raise BackendError(f"the model {spec.name!r}: an upstream section goes with a remote backend, "
                               f"and backend {backend!r} is {backend_kind(backend_cls)}")  # fmt: skip
        return _open_remote(spec, backend, backend_cls, upstream_key, egress)
    return _start_engine(spec, backend, backend_cls, engine_config, on_stage or (lambda _: None))


def _start_engine(spec: ModelSpec, backend: str, backend_cls: Any, engine_config: EngineConfig | None,
                  stage: Callable[[str], None]) -> ServedModel:  # fmt: skip
    """A model of an engine backend: its weights (and draft model) loaded, its engine thread started."""
    from inferflux.backends.base import serves_embeddings
    from inferflux.backends.engine import AsyncEngine, EngineConfig, LLMEngine
    from inferflux.backends.models import open_model

    instance = backend_cls()
    started = time.perf_counter()
    stage("loading weights")
    info = instance.load(spec)
    config = engine_config if engine_config is not None else EngineConfig()
    draft = None
    if config.speculative is not None and config.speculative.draft_model is not None:
        stage("loading draft model")
        draft = load_draft_model(backend_cls, spec, config.speculative.draft_model, info)
    stage("loading tokenizer")
    tokenizer = open_model(spec.path).tokenizer()
    stage("starting engine")
    engine = LLMEngine(instance, tokenizer, info, config, draft_backend=draft)
    aengine = AsyncEngine(engine)
    aengine.start()
    log.info("loaded model %s (%s, %s) on %s in %.1fs", spec.name, info.architecture, info.dtype, backend,
             time.perf_counter() - started)  # fmt: skip
    return ServedModel(name=spec.name, aliases=tuple(spec.aliases), tokenizer=tokenizer, info=info, engine=aengine,
                       backend=backend, speculative=config.speculative, embeds=serves_embeddings(instance))  # fmt: skip


def _open_remote(spec: ModelSpec, backend: str, backend_cls: Any, api_key: str | None,
                 egress: EgressPolicy | None) -> ServedModel:  # fmt: skip
    """A model of a remote backend: its engine-shaped client over the upstream fleet."""
    from inferflux.backends.openai.egress import EgressPolicy
    from inferflux.backends.openai.fleet import FleetConfig

    upstream = dict(spec.upstream or {})
    # FleetConfig raises ValueError for what it cannot use (an unreadable ca_file, an endpoint the egress
    # rules refuse): the model does not load.
    config = FleetConfig(
        endpoints=tuple(upstream["endpoints"]),
        api_key=api_key,
        timeout_seconds=float(upstream.get("timeout_seconds", 600.0)),
        idle_timeout_seconds=float(upstream.get("idle_timeout_seconds", 60.0)),
        max_inflight_per_endpoint=int(upstream.get("max_inflight_per_endpoint", 64)),
        retries=int(upstream.get("retries", 2)),
        health_interval_seconds=float(upstream.get("health_interval_seconds", 5.0)),
        ca_file=upstream.get("ca_file"),
        routing=upstream.get("routing", "prefix"),
        egress=egress or EgressPolicy(),
    )
    context = int(upstream.get("context_length") or 0)
    engine = backend_cls().open(config, upstream_model=upstream.get("model") or spec.name, max_model_len=context)
    info = ModelInfo(name=spec.name, architecture="upstream", vocab_size=0, context_length=context, num_layers=0,
                     num_kv_heads=0, head_dim=0, dtype="upstream")  # fmt: skip
    log.info("serving model %s from %d upstream endpoint(s) on %s", spec.name, len(config.endpoints), backend)
    return ServedModel(name=spec.name, aliases=tuple(spec.aliases), tokenizer=None, info=info, engine=engine,
                       backend=backend, remote=True, upstream=upstream)  # fmt: skip
