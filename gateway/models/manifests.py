"""Model manifests: every replica polls ``registry.path`` and serves what its files say, without a restart.

Each poll (``registry.poll_interval_seconds``) reads the directory
(``gateway.models.manifest_files``) and compares each file's content hash with
the version it last applied; a file's modification time is never trusted.

- A new file loads its model; once loaded it is served (``/v1/models``) under
  its name and aliases.
- A changed file loads the new version beside the old one, which keeps serving
  meanwhile; the new one is swapped in once ready (``ModelManager.replace``),
  and the old one drains: the requests it holds finish (for up to
  ``server.shutdown_grace_seconds``), then its engine stops.
- A removed file takes its model out at once (a new request for it is a 404)
  and drains it the same way.
- A bad file (YAML or schema error, unreadable, a link, too large, a model
  file missing, a load that fails, a name already served) changes nothing: the
  version already served, if any, keeps serving. It is logged once per content
  version, listed by file name in ``/readyz``'s ``manifest_errors`` and in the
  ``inferflux_registry_manifest_errors`` gauge, and cleared once the file is
  fixed (or removed, or put back to the version served).

Names: the configuration file's models come first, then the admin API's
registry, then the manifests, and among manifests the file applied first. A
manifest naming a model (or alias) already served from elsewhere is reported
and not loaded, and tried again at every poll (logged once) until the name is
free; the admin API can neither unload a manifest's model nor load
another under its name (409), and a registry convergence never unloads it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from inferflux.gateway.models.admin import ModelAdmin
from inferflux.gateway.models.loads import check_path
from inferflux.gateway.models.manifest_files import ManifestError, ManifestFile, parse, scan, scrub
from inferflux.gateway.models.served import ServedModel, engine_config_from, load_served_model
from inferflux.gateway.models.upstreams import upstream_key
from inferflux.gateway.settings import ManifestRegistrySettings, ModelEntry
from inferflux.policy.errors import ValidationFailed

log = logging.getLogger("inferflux.gateway.models.manifests")

DIRECTORY = "(directory)"  # the key of the directory's own error in ``errors()``


@dataclass(frozen=True)
class _Version:
    digest: str
    text: str  # the model's name (applied) or the error (reported)
    retry: bool = False  # reported: tried again at every poll (a name taken elsewhere may come free)


class _NameTaken(ManifestError):
    """The manifest's name or an alias is served from elsewhere: not the file's fault, so tried at every poll."""


class ManifestWatcher:
    """Follows one directory of manifests for ``admin``'s manager (``start`` in the app's lifespan)."""

    def __init__(self, admin: ModelAdmin, registry: ManifestRegistrySettings, grace: float) -> None:
        if registry.path is None:
            raise ValueError("registry.path is not set")
        self.admin, self.manager = admin, admin.manager
        self.directory, self.interval = registry.path, registry.poll_interval_seconds
        self.max_bytes = registry.max_manifest_bytes
        self.grace = grace
        self._applied: dict[str, _Version] = {}  # file -> the digest served, and its model's name
        self._errors: dict[str, _Version] = {}  # file -> the digest reported, and why
        self._task: asyncio.Task[None] | None = None
        self._loading: asyncio.Future[ServedModel] | None = None  # the load in progress, on its thread
        self._drains: set[asyncio.Task[None]] = set()

    def errors(self) -> dict[str, str]:
        """The manifests in error now, by file name (``DIRECTORY`` for the directory itself)."""
        return {name: version.text for name, version in sorted(self._errors.items())}

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="model-manifests")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        loading, self._loading = self._loading, None
        if loading is not None:  # its thread runs on: the model it loads is never served, so stop it
            [orphan] = await asyncio.gather(loading, return_exceptions=True)
            if isinstance(orphan, ServedModel):
                await asyncio.to_thread(orphan.shutdown)
        if self._drains:  # the engines still draining stop now (the app is stopping)
            await asyncio.gather(*self._drains, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # a bug must not stop the loop: the models served keep serving
                log.exception("polling the model manifests in %s failed", self.directory)
            await asyncio.sleep(self.interval)

    async def poll(self) -> None:
        """One look at the directory: load, reload and drain what changed since the last."""
        try:
            files = await asyncio.to_thread(scan, self.directory, self.max_bytes)
        except OSError as exc:  # an unmounted volume: keep every model as it is, say so once
            self._report(DIRECTORY, _Version(str(exc.errno), f"cannot be listed ({exc.strerror or exc})"))
            return
        self._errors.pop(DIRECTORY, None)
        for name in [n for n in self._errors if n not in files]:
            del self._errors[name]  # a bad file removed: nothing to report any more
        for name in sorted(self._applied.keys() - files.keys()):
            self._retire_file(name)
        for name in sorted(files):
            await self._apply(files[name])

    async def _apply(self, file: ManifestFile) -> None:
        applied = self._applied.get(file.name)
        if applied is not None and applied.digest == file.digest:
            self._errors.pop(file.name, None)  # put back to the version served
            return
        reported = self._errors.get(file.name)
        if reported is not None and reported.digest == file.digest and not reported.retry:
            return  # reported once already
        try:
            entry = parse(file)
            self._check_names(file.name, entry)
            served = await self._load_shielded(entry)
        except ManifestError as exc:
            self._report(file.name, _Version(file.digest, str(exc), retry=isinstance(exc, _NameTaken)))
            return
        except Exception as exc:  # a backend's or an upstream's refusal: reported like a bad file
            self._report(file.name, _Version(file.digest, scrub(f"the model does not load: {exc}")))
            return
        try:
            self._serve(file.name, served, applied)
        except ValueError as exc:  # a name taken while it loaded (an admin API load, say)
            await asyncio.to_thread(served.shutdown)
            self._report(file.name, _Version(file.digest, str(exc)))
            return
        self._applied[file.name] = _Version(file.digest, served.name)
        self._errors.pop(file.name, None)
        log.info("model %s %s from manifest %s", served.name, "reloaded" if applied else "loaded", file.name)

    def _check_names(self, file: str, entry: ModelEntry) -> None:
        """The entry's names are free for this file: not the configuration's, another file's, or served otherwise."""
        if entry.name in self.admin.configured:
            raise _NameTaken(f"the model {entry.name!r} is defined in the configuration file, which wins")
        mine = {v.text for f, v in self._applied.items() if f == file}
        for key in (entry.name, *entry.aliases):
            holder = next((m for m in self.manager if key in (m.name, *m.aliases)), None)
            if holder is not None and holder.name not in mine:
                other = next((f for f, v in self._applied.items() if v.text == holder.name), None)
                where = f"manifest {other}" if other else "the admin API's registry"
                raise _NameTaken(f"the name or alias {key!r} is already served (model {holder.name!r}, from {where})")

    async def _load_shielded(self, entry: ModelEntry) -> ServedModel:
        """``_load`` on a thread; a stop while it runs leaves it in ``_loading`` for ``stop`` to shut down."""
        self._loading = asyncio.ensure_future(asyncio.to_thread(self._load, entry))
        try:
            served = await asyncio.shield(self._loading)
        except Exception:
            self._loading = None
            raise
        self._loading = None
        return served

    def _load(self, entry: ModelEntry) -> ServedModel:
        """The entry loaded as a configuration file's would be (blocking: on a thread)."""
        settings = self.admin.settings
        spec, backend = settings.model_spec(entry)
        if entry.upstream is None:
            try:
                check_path(spec.path)
            except ValidationFailed as exc:
                raise ManifestError(scrub(f"path: {exc.message}")) from None
        key = upstream_key(self.admin.store, spec.upstream, settings, self.admin.egress)  # checks the section too
        served = load_served_model(spec, backend, engine_config_from(settings.engine, entry.speculative),
                                   priority=settings.runtime.backend_priority, upstream_key=key,
                                   egress=self.admin.egress)  # fmt: skip
        served.embedding = None if entry.embedding is None else entry.embedding.model_dump()
        return served

    def _serve(self, file: str, served: ServedModel, applied: _Version | None) -> None:
        """``served`` in place of the file's previous model (same name: swapped in one step), that one drained."""
        old: ServedModel | None = None
        if applied is not None and applied.text == served.name:
            old = self.manager.replace(served)
        else:
            self.manager.add(served)
            if applied is not None:  # renamed: the old name leaves
                old = self.manager.remove(applied.text)
                self.admin.manifested.discard(applied.text)
        self.admin.manifested.add(served.name)
        if old is not None:
            self._drain(old)

    def _retire_file(self, file: str) -> None:
        name = self._applied.pop(file).text
        self.admin.manifested.discard(name)
        try:
            model = self.manager.remove(name)
        except Exception:  # not served any more (cannot happen: the admin API refuses to unload it)
            return
        log.info("manifest %s was removed; draining model %s", file, name)
        self._drain(model)

    def _drain(self, model: ServedModel) -> None:
        task = asyncio.create_task(drain(model, self.grace), name=f"drain-model-{model.name}")
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    def _report(self, file: str, version: _Version) -> None:
        if self._errors.get(file) == version:
            return
        self._errors[file] = version
        log.error("model manifest %s is not applied (the model served before, if any, keeps serving): %s",
                  file, version.text)  # fmt: skip


async def drain(model: ServedModel, grace: float, settle: float = 0.2) -> None:
    """Stop ``model``'s engine once the requests it holds have finished (at most ``grace`` seconds).

    ``model`` is already out of the manager, so no new request finds it; one that
    found it just before may not have reached its engine yet, so the engine must
    be idle for ``settle`` seconds running before it is stopped.
    """
    deadline = time.monotonic() + grace
    idle_since: float | None = None
    while time.monotonic() < deadline:
        if _busy(model):
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= settle:
            break
        await asyncio.sleep(0.05)
    else:
        log.warning("model %s still had requests after %.0f s; stopping it", model.name, grace)
    await asyncio.to_thread(model.shutdown)
    log.info("model %s drained and stopped", model.name)


def _busy(model: ServedModel) -> bool:
    stats: Any = model.engine.stats()
    return bool(stats.num_running or stats.num_waiting or getattr(stats, "num_waiting_embeddings", 0))
