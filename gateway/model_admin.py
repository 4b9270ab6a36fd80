"""Loading, unloading and choosing models at run time (the admin API's models).

Models come from two places:

* the configuration file (or ``--model``): loaded at start, always; the admin
  API may make one the default but cannot unload it (edit the file instead);
* the admin API: loaded in the background, recorded in the policy store once
  ready, and loaded again at every start, so a restart serves the same set.

A load runs on a worker thread; its stage and elapsed time are visible in
``describe`` while it runs, and its error if it fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.base import ModelSpec

from gateway.auth import call_store
from gateway.models import ModelManager, ServedModel, engine_config_from, load_served_model
from gateway.settings import Settings
from policy.errors import Conflict, NotFound, ValidationFailed
from policy.store import PolicyStore

log = logging.getLogger("inferflux.gateway.model_admin")


@dataclass
class _Load:
    name: str
    path: str
    backend: str
    dtype: str
    aliases: tuple[str, ...]
    default: bool
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
        }


class ModelAdmin:
    def __init__(self, manager: ModelManager, store: PolicyStore, settings: Settings, configured: set[str]) -> None:
        self.manager = manager
        self.store = store
        self.settings = settings
        self.configured = set(configured)  # names from the configuration file
        self._loads: dict[str, _Load] = {}
        self._tasks: set[asyncio.Task[None]] = set()

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
            "architecture": served.info.architecture,
            "context_length": served.max_model_len,
            "default": self.manager.default_name == served.name,
            "source": "config" if served.name in self.configured else "admin",
        }

    # -- changing

    def _check_names(self, name: str, aliases: list[str]) -> None:
        for key in (name, *aliases):
            taken = key in self._loads or any(key in (m.name, *m.aliases) for m in self.manager)
            if taken:
                raise Conflict(f"The model name or alias '{key}' is already in use", param="name")

    @staticmethod
    def _check_path(path: str) -> None:
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

    def _check_backend(self, name: str) -> None:
        from backends.registry import probe

        status = probe(name, priority=self.settings.runtime.backend_priority)
        if not status.available:
            raise ValidationFailed(f"backend '{name}' cannot be used: {status.reason}", param="backend")

    async def load(
        self,
        *,
        name: str,
        path: str,
        backend: str | None,
        dtype: str | None,
        aliases: list[str],
        default: bool,
    ) -> dict[str, Any]:
        """Validate now, load in the background; the returned status says 'loading'."""
        self._check_names(name, aliases)
        self._check_path(path)
        backend = backend or self.settings.backend
        self._check_backend(backend)
        load = _Load(name, path, backend, dtype or self.settings.dtype, tuple(aliases), default)
        self._loads[name] = load
        self.manager.mark_loading(name, True)
        task = asyncio.create_task(self._run(load, persist=True), name=f"load-model-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return load.describe()

    async def _run(self, load: _Load, *, persist: bool) -> None:
        spec = ModelSpec(name=load.name, path=load.path, dtype=load.dtype, aliases=load.aliases)

        def on_stage(stage: str) -> None:
            load.stage = stage

        try:
            served = await asyncio.to_thread(
                load_served_model, spec, load.backend, engine_config_from(self.settings.engine), on_stage,
                self.settings.runtime.backend_priority,
            )
        except Exception as exc:  # a failed load is reported on the model, not raised anywhere
            log.error("loading model %s from %s failed: %s", load.name, load.path, exc)
            load.status, load.stage, load.error, load.finished = "failed", "failed", str(exc), time.monotonic()
            self.manager.mark_loading(load.name, False)
            return
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
                )
        except Exception as exc:
            log.error("registering model %s failed: %s", load.name, exc)
            if added:
                # Its engine stops below: it must not stay served (nor the default) without one.
                self.manager.remove(load.name)
                if load.default and previous_default in {m.name for m in self.manager}:
                    self.manager.set_default(previous_default)
            await asyncio.to_thread(served.shutdown)
            load.status, load.stage, load.error, load.finished = "failed", "failed", str(exc), time.monotonic()
            self.manager.mark_loading(load.name, False)
            return
        del self._loads[load.name]
        self.manager.mark_loading(load.name, False)
        log.info("model %s is ready", load.name)

    async def unload(self, name: str) -> None:
        load = self._loads.get(name)
        if load is not None:
            if load.status == "loading":
                raise Conflict(f"The model '{name}' is still loading; unload it once it is ready")
            del self._loads[name]  # forget a failed load
            return
        try:
            served = self.manager.get(name)
        except Exception:
            raise NotFound(f"No model '{name}'") from None
        if served.name in self.configured:
            raise Conflict(f"The model '{served.name}' comes from the configuration file; remove it there")
        self.manager.remove(served.name)
        await asyncio.to_thread(served.shutdown)
        record = await call_store(self.store.get_served_model_by_name, served.name)
        await call_store(self.store.delete_served_model, record.id)

    async def set_default(self, name: str) -> dict[str, Any]:
        try:
            served = self.manager.get(name)
        except Exception:
            raise NotFound(f"No model '{name}' is ready") from None
        if served.name in self.configured:
            # A configured model has no record in the store. Clear the stored
            # mark instead, or the next start would make the admin-loaded model
            # that holds it the default again (restore() follows the mark).
            for record in await call_store(self.store.list_served_models):
                if record.is_default:
                    await call_store(self.store.update_served_model, record.id, is_default=False)
        else:
            await call_store(self.store.set_default_served_model, served.name)
        self.manager.set_default(served.name)
        return self._describe_served(served)

    def restore(self) -> list[str]:
        """At start: load the models the admin API registered before (synchronously).

        Returns the names that failed; they are logged, and the server starts
        without them rather than not at all.
        """
        failed = []
        for record in self.store.list_served_models():
            if record.name in self.configured:
                continue
            spec = ModelSpec(name=record.name, path=record.path, dtype=record.dtype, aliases=tuple(record.aliases))
            try:
                served = load_served_model(spec, record.backend, engine_config_from(self.settings.engine),
                                           priority=self.settings.runtime.backend_priority)
                self.manager.add(served, default=record.is_default)
            except Exception as exc:
                log.error("cannot load registered model %s (%s): %s", record.name, record.path, exc)
                failed.append(record.name)
        return failed

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
