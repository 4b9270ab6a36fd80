"""Backend discovery through the ``inferflux.backends`` entry-point group.

A backend is any class registered under that group, by this distribution or a
third-party one; nothing here imports a tensor library until a backend is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from backends.base import Backend, BackendError

GROUP = "inferflux.backends"


@dataclass(frozen=True)
class BackendStatus:
    name: str
    available: bool
    reason: str | None  # why it cannot run here, when unavailable


def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def backend_names() -> list[str]:
    return sorted(_entry_points())


def _load_class(ep: EntryPoint) -> type[Backend]:
    try:
        return ep.load()
    except Exception as exc:  # a plugin that fails to import is unavailable, not fatal
        raise BackendError(f"backend {ep.name!r} failed to import: {exc}") from exc


def probe(name: str) -> BackendStatus:
    eps = _entry_points()
    if name not in eps:
        return BackendStatus(name, False, f"no backend named {name!r} is installed")
    try:
        cls = _load_class(eps[name])
        reason = cls.probe()
    except BackendError as exc:
        return BackendStatus(name, False, str(exc))
    return BackendStatus(name, reason is None, reason)


def get_backend(name: str) -> type[Backend]:
    """The class registered as ``name``; raises BackendError saying why it cannot run."""
    eps = _entry_points()
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none"
        raise BackendError(f"unknown backend {name!r} (installed: {known})")
    cls = _load_class(eps[name])
    reason = cls.probe()
    if reason is not None:
        raise BackendError(f"backend {name!r} is not available on this machine: {reason}")
    return cls
