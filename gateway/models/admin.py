"""Loading, unloading and choosing models at run time (the admin API's models).

Models come from two places:

* the configuration file (or ``--model``): loaded at start, always; the admin
  API may make one the default but cannot unload it (edit the file instead);
* the admin API: loaded in the background, recorded in the policy store once
  ready, and loaded again at every start, so a restart serves the same set.

The store's registry is the fleet's: every replica follows it while it runs
(``converge``, called by ``gateway.models.sync`` when the store changed), loading
a model another replica registered, unloading one another replica unloaded
(never one from this replica's configuration file) and taking the stored
default. So the admin API answers the same on every replica: ``DELETE`` on any
of them takes a model out of the registry, failed loads included, and
``POST .../default`` moves every replica's default.

A load runs on a worker thread; its stage and elapsed time are visible in
``describe`` while it runs, and its error if it fails. A load the registry
asked for that failed is tried again only once the store changed again, not
at every poll.

One lock orders the changes that span an ``await`` (a load's registration, an
unload, a new default, a convergence): each sees the store and this replica's
models agree, so a convergence never undoes a change half made here, nor loads
this replica's own model twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from inferflux.backends.base import ModelSpec

from inferflux.gateway.auth import call_store
from inferflux.gateway.models.loads import ModelLoad, checked_load
from inferflux.gateway.models.served import ModelManager, ServedModel, engine_config_from, load_served_model
from inferflux.gateway.settings import Settings
from inferflux.gateway.models.sync import RegistryPoller
from inferflux.gateway.models.upstreams import egress_policy, upstream_key
from inferflux.policy.errors import Conflict, NotFound
from inferflux.policy.store import PolicyStore, ServedModelRecord

log = logging.getLogger("inferflux.gateway.models.admin")


class ModelAdmin:
    def __init__(self, manager: ModelManager, store: PolicyStore, settings: Settings, configured: set[str]) -> None:
        self.manager = manager
        self.store = store
        self.settings = settings
        self.configured = set(configured)  # names from the configuration file
        # Names served from manifest files (gateway.models.manifests keeps it): neither unloaded by a
        # convergence nor through the admin API; their file is where they change.
        self.manifested: set[str] = set()
        self.egress = egress_policy(settings)  # where upstream models may connect
        self._loads: dict[str, ModelLoad] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()
        self._poller: RegistryPoller | None = None
        self._version: int | None = None  # the policy_version last converged on
        self._look_again = False  # a load ended: converge at the next poll even if the store did not move

    # -- reading

    def describe(self, name: str) -> dict[str, Any]:
        load = self._loads.get(name)
        if load is not None:
            return load.describe()
        try:
            served = self.manager.get(name)
        except Exception:
            raise NotFound(f"No model '{name}'") from None
        return self._describe_served(served)

    def describe_all(self) -> list[dict[str, Any]]:
        return [self._describe_served(m) for m in self.manager] + [load.describe() for load in self._loads.values()]

    def _describe_served(self, served: ServedModel) -> dict[str, Any]:
        return {
            "object": "model",
            "id": served.name,
            "status": "ready" if served.engine.is_running else "failed",
            "aliases": list(served.aliases),
            "backend": served.backend,
            "dtype": served.info.dtype,
            "deterministic": served.info.deterministic,
            "architecture": served.info.architecture,
            "context_length": served.max_model_len,
            "default": self.manager.default_name == served.name,
            "source": self._source(served.name),
            **({"upstream": served.engine.describe()} if served.remote else {}),
            **({"embedding": dict(served.embedding)} if served.embedding is not None else {}),
            # The load-time passes (backends/cpu/passes.py): what ran, weight bytes before and after.
            **({"passes": [dict(r) for r in served.info.passes]} if served.info.passes else {}),
        }

    def _source(self, name: str) -> str:
        return "config" if name in self.configured else "manifest" if name in self.manifested else "admin"

    # -- changing

    def _check_names(self, name: str, aliases: list[str]) -> None:
        for key in (name, *aliases):
            taken = key in self._loads or any(key in (m.name, *m.aliases) for m in self.manager)
            if taken:
                raise Conflict(f"The model name or alias '{key}' is already in use", param="name")

    async def load(
        self,
        *,
        name: str,
        path: str | None,
        backend: str | None,
        dtype: str | None,
        aliases: list[str],
        default: bool,
        upstream: dict[str, Any] | None = None,
        embedding: dict[str, Any] | None = None,
        deterministic: bool | None = None,
        passes: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Validate now, load in the background; the returned status says 'loading'.

        A model with an ``upstream`` is served by the remote backend from the
        endpoints it names, under the ``upstreams`` section's rules
        (``gateway.models.upstreams``); a credential or variable it names must exist.
        ``embedding`` (a checked ``EmbeddingSettings``, dumped) is kept with the
        model, as a configuration file's ``models[].embedding`` is. ``deterministic``
        unset takes ``engine.deterministic`` for a local model; ``passes`` (a checked
        ``PassesSettings``, dumped without unset keys) goes over ``engine.passes`` key by key.
        """
        self._check_names(name, aliases)
        load = await checked_load(self.settings, self.store, self.egress, name=name, path=path, backend=backend,
                                  dtype=dtype, aliases=tuple(aliases), default=default, upstream=upstream,
                                  embedding=embedding, deterministic=deterministic, passes=passes)  # fmt: skip
        self._start(load, persist=True)
        return load.describe()

    def _start(self, load: ModelLoad, *, persist: bool) -> None:
        self._loads[load.name] = load
        self.manager.mark_loading(load.name, True)
        task = asyncio.create_task(self._run(load, persist=persist), name=f"load-model-{load.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, load: ModelLoad, *, persist: bool) -> None:
        spec = ModelSpec(name=load.name, path=load.path, dtype=load.dtype, aliases=load.aliases, upstream=load.upstream,
                         deterministic=load.deterministic, passes=load.passes)  # fmt: skip

        def on_stage(stage: str) -> None:
            load.stage = stage

        try:
            # A record from the store is held to today's rules there, as a new one is (BackendError if not).
            key = await call_store(upstream_key, self.store, load.upstream, self.settings, self.egress)
            served = await asyncio.to_thread(
                load_served_model, spec, load.backend, engine_config_from(self.settings.engine), on_stage,
                self.settings.runtime.backend_priority, key, self.egress,
            )
        except Exception as exc:  # a failed load is reported on the model, not raised anywhere
            log.error("loading model %s from %s failed: %s", load.name, load.path, exc)
            self._failed(load, exc)
            return
        served.embedding = load.embedding
        async with self._lock:  # the model served and recorded together, as a convergence sees it
            previous_default = self.manager.default_name
            added = False
            try:
                self.manager.add(served, default=load.default)
                added = True
                if persist:
                    await call_store(
                        self.store.create_served_model,
                        name=load.name,
                        path=load.path,
                        backend=load.backend,
                        dtype=load.dtype,
                        aliases=list(load.aliases),
                        is_default=load.default,
                        upstream=load.upstream,
                        embedding=load.embedding,
                        deterministic=load.deterministic,
                        passes=load.passes,
                    )
            except Exception as exc:
                log.error("registering model %s failed: %s", load.name, exc)
                if added:
                    # Its engine stops below: it must not stay served (nor the default) without one.
                    self.manager.remove(load.name)
                    if load.default and previous_default in {m.name for m in self.manager}:
                        self.manager.set_default(previous_default)
                await asyncio.to_thread(served.shutdown)
                self._failed(load, exc)
                return
            self._loads.pop(load.name, None)
            self.manager.mark_loading(load.name, False)
            # Another look at the registry: the default, or an unload, may have come meanwhile.
            self._look_again = True
        log.info("model %s is ready", load.name)

    def _failed(self, load: ModelLoad, exc: Exception) -> None:
        load.status, load.stage, load.error, load.finished = "failed", "failed", str(exc), time.monotonic()
        load.version = self._version  # tried again from the registry once the store has moved past this
        self.manager.mark_loading(load.name, False)
        # Another look: this replica's own load may have lost the name to another replica's.
        self._look_again = True

    async def unload(self, name: str) -> None:
        """Take ``name`` out of the registry (first, so a store that fails changes nothing), then unload it."""
        async with self._lock:
            load = self._loads.get(name)
            if load is not None:
                if load.status == "loading":
                    raise Conflict(f"The model '{name}' is still loading; unload it once it is ready")
                if load.stored:  # it failed here, but the registry has it: out of the registry, as for any replica
                    await self._unregister(name)
                del self._loads[name]  # forget a failed load
                return
            try:
                served = self.manager.get(name)
            except Exception:
                raise NotFound(f"No model '{name}'") from None
            if served.name in self.configured:
                raise Conflict(f"The model '{served.name}' comes from the configuration file; remove it there")
            if served.name in self.manifested:
                raise Conflict(f"The model '{served.name}' comes from a manifest file; remove the file")
            await self._unregister(served.name)
            self.manager.remove(served.name)
            await asyncio.to_thread(served.shutdown)

    async def _unregister(self, name: str) -> None:
        try:
            record = await call_store(self.store.get_served_model_by_name, name)
            await call_store(self.store.delete_served_model, record.id)
        except NotFound:  # another replica took it out first
            pass

    async def set_default(self, name: str) -> dict[str, Any]:
        async with self._lock:
            try:
                served = self.manager.get(name)
            except Exception:
                raise NotFound(f"No model '{name}' is ready") from None
            if served.name in self.configured or served.name in self.manifested:
                # A configured (or manifest's) model has no record in the store. Clear the stored
                # mark instead, or the next start would make the admin-loaded model
                # that holds it the default again (restore() follows the mark).
                for record in await call_store(self.store.list_served_models):
                    if record.is_default:
                        await call_store(self.store.update_served_model, record.id, is_default=False)
            else:
                await call_store(self.store.set_default_served_model, served.name)
            self.manager.set_default(served.name)
            return self._describe_served(served)

    # -- following the registry (the other replicas' changes)

    async def converge(self, version: int) -> None:
        """Serve what the store's registry holds: load what is missing, unload what left it, take its default.

        ``version`` is the store's ``policy_version`` just read (``gateway.models.sync``).
        A model of the configuration file is never unloaded.
        """
        async with self._lock:
            records = await call_store(self.store.list_served_models)
            self._version, self._look_again = version, False
            stored = {record.name: record for record in records}
            for record in records:
                if self._wants(record):
                    self._follow(record)
            for name, load in list(self._loads.items()):
                if load.stored and load.status == "failed" and name not in stored:
                    del self._loads[name]  # it left the registry: nothing to report any more
            retired = [
                self.manager.remove(model.name)
                for model in self.manager
                if model.name not in self.configured | self.manifested and model.name not in stored
            ]
            self._take_default(records)
            await self._refresh_upstream_keys()
        for model in retired:  # outside the lock: stopping an engine joins its threads
            log.info("model %s left the registry; unloading it", model.name)
            await asyncio.to_thread(model.shutdown)

    async def _refresh_upstream_keys(self) -> None:
        """Remote models whose key is a stored credential take its current secret (it may have been rotated)."""
        for model in self.manager:
            if model.remote and model.upstream is not None and model.upstream.get("credential"):
                try:
                    key = await call_store(upstream_key, self.store, model.upstream, self.settings, self.egress)
                    model.engine.set_api_key(key)
                except Exception as exc:  # a deleted credential: keep the last key, say so
                    log.error("the upstream key of model %s cannot be refreshed: %s", model.name, exc)

    def _wants(self, record: ServedModelRecord) -> bool:
        """Whether ``record`` should start loading here now."""
        if any(model.name == record.name for model in self.manager):
            return False
        load = self._loads.get(record.name)
        if load is None:
            return True
        if load.status == "loading":
            return False
        # Failed. This replica's own attempt gives way to the registry's; the
        # registry's own is tried again only once the store has changed since.
        return not load.stored or load.version != self._version

    def _follow(self, record: ServedModelRecord) -> None:
        """Start loading ``record`` in the background, as a load that is not recorded again."""
        self._loads.pop(record.name, None)  # a failed attempt, replaced by this one
        load = ModelLoad(record.name, record.path, record.backend, record.dtype, record.aliases, record.is_default,
                     record.upstream, record.embedding, record.deterministic, record.passes, stored=True,
                     version=self._version)  # fmt: skip
        try:
            self._check_names(record.name, list(record.aliases))
        except Conflict as exc:  # a name this replica's configuration serves: reported, not loaded
            self._loads[load.name] = load
            self._failed(load, exc)
            return
        log.info("model %s is in the registry; loading it", record.name)
        self._start(load, persist=False)

    def _take_default(self, records: list[ServedModelRecord]) -> None:
        wanted = next((record.name for record in records if record.is_default), None)
        for load in self._loads.values():
            if load.stored and load.status == "loading":
                load.default = load.name == wanted
        served = [model.name for model in self.manager]
        current = self.manager.default_name
        if wanted is None:
            # No stored mark: a configured model is the default (which one the store
            # does not say, so this replica's first), not one the registry holds.
            if current is not None and current not in self.configured:
                fallback = next((name for name in served if name in self.configured), None)
                if fallback is not None:
                    self.manager.set_default(fallback)
        elif wanted in served and current != wanted:
            self.manager.set_default(wanted)

    def restore(self) -> list[str]:
        """At start: load the models the admin API registered before (synchronously).

        Returns the names that failed; they are logged, and the server starts
        without them rather than not at all.
        """
        failed = []
        for record in self.store.list_served_models():
            if record.name in self.configured:
                continue
            spec = ModelSpec(name=record.name, path=record.path, dtype=record.dtype, aliases=tuple(record.aliases),
                             upstream=record.upstream, deterministic=record.deterministic,
                             passes=record.passes)  # fmt: skip
            try:
                key = upstream_key(self.store, record.upstream, self.settings, self.egress)  # checks it too
                served = load_served_model(spec, record.backend, engine_config_from(self.settings.engine),
                                           priority=self.settings.runtime.backend_priority, upstream_key=key,
                                           egress=self.egress)  # fmt: skip
                served.embedding = record.embedding
                self.manager.add(served, default=record.is_default)
            except Exception as exc:
                log.error("cannot load registered model %s (%s): %s", record.name, record.path, exc)
                failed.append(record.name)
        return failed

    # -- running

    def start(self) -> None:
        """Follow the registry from now on (the app's lifespan; ``aclose`` stops it)."""
        self._lock = asyncio.Lock()  # one per run: a lock belongs to the loop it is used on
        self._poller = RegistryPoller(
            self.store, self.converge, lambda: self._look_again, self.settings.model_registry.poll_seconds
        )
        self._poller.start()

    async def aclose(self) -> None:
        if self._poller is not None:
            await self._poller.stop()
            self._poller = None
        for task in list(self._tasks):
            task.cancel()
