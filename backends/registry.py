"""Backend discovery, probing and choice.

A backend is any class registered under the ``inferflux.backends`` entry-point
group, by this distribution or a third-party one. Three rules sit on top of
discovery:

- Allow-list: with ``INFERFLUX_BACKENDS_ALLOWED`` set (comma separated), a
  backend not on it is reported as not allowed and its module is never imported.
  An entry point is arbitrary code; this is how an operator pins what may run.
- Probe: each allowed backend's ``probe()`` says whether it can run here, and
  if not, why.
- Priority chain: the name ``auto`` resolves to the first backend of the chain
  that is allowed and available. The chain is ``runtime.backend_priority`` from
  the settings, else ``INFERFLUX_BACKEND_PRIORITY``, else ``DEFAULT_PRIORITY``.
  An explicitly named backend never falls back: if it cannot run, that is an
  error that says why.

Nothing here imports a tensor library; probing imports only the backends asked about.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from inferflux.backends.base import Backend, BackendError, backend_kind

GROUP = "inferflux.backends"
AUTO = "auto"
PRIORITY_ENV = "INFERFLUX_BACKEND_PRIORITY"
ALLOWED_ENV = "INFERFLUX_BACKENDS_ALLOWED"


def default_priority(system: str | None = None) -> tuple[str, ...]:
    """The chain used when none is configured: genuinely fast accelerators first.

    MLX on macOS runs on the Apple GPU, so it comes before the CPU there; on
    Linux mlx is a CPU build with reference BLAS, far slower than the cpu
    backend, so it comes last.
    """
    if (system or platform.system()) == "Darwin":
        return ("cuda", "metal", "mlx", "cpu")
    return ("cuda", "metal", "cpu", "mlx")


@dataclass(frozen=True)
class BackendStatus:
    name: str
    available: bool
    reason: str | None  # why it cannot run here, when unavailable
    allowed: bool = True  # False: blocked by the allow-list, never imported
    provider: str | None = None  # the distribution that registers it, "name version"
    target: str | None = None  # the entry point's "module:Class"
    kind: str = "engine"  # "remote": serves whole requests from upstream servers (``backends.base.RemoteBackend``)


def parse_names(value: str | Iterable[str], what: str) -> tuple[str, ...]:
    """Backend names from a comma-separated string or a list; empty items are dropped.

    Raises BackendError for ``auto`` (not a backend) and for repeated names.
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    names: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise BackendError(f"{what}: backend names must be strings, got {item!r}")
        name = item.strip()
        if not name:
            continue
        if name == AUTO:
            raise BackendError(f"{what}: {AUTO!r} is not a backend name")
        if name in names:
            raise BackendError(f"{what}: backend {name!r} is listed twice")
        names.append(name)
    return tuple(names)


def configured_priority(
    priority: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """``priority`` if given, else ``INFERFLUX_BACKEND_PRIORITY``, else the default chain."""
    if priority is not None:
        return parse_names(priority, "backend priority")
    raw = (os.environ if env is None else env).get(PRIORITY_ENV, "")
    if raw.strip():
        return parse_names(raw, PRIORITY_ENV)
    return default_priority()


def allowed_backends(env: Mapping[str, str] | None = None) -> frozenset[str] | None:
    """The names ``INFERFLUX_BACKENDS_ALLOWED`` lists; None when it is unset or empty (all allowed)."""
    raw = (os.environ if env is None else env).get(ALLOWED_ENV, "")
    if not raw.strip():
        return None
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def _discover() -> dict[str, list[EntryPoint]]:
    """Every registered name with its entry points (more than one: a conflict)."""
    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=GROUP):
        found.setdefault(ep.name, []).append(ep)
    return found


def backend_names() -> list[str]:
    return sorted(_discover())


def _provider(ep: EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else None


def _allowed(allowed: Iterable[str] | None) -> frozenset[str] | None:
    return allowed_backends() if allowed is None else frozenset(allowed)


def _check(name: str, allowed: frozenset[str] | None) -> tuple[BackendStatus, type[Backend] | None]:
    """The status of one named backend, and its class when it can run here."""
    eps = _discover().get(name, [])
    if not eps:
        return BackendStatus(name, False, "not installed (no entry point of that name)"), None
    provider = ", ".join(p for p in (_provider(ep) for ep in eps) if p) or None
    target = ", ".join(ep.value for ep in eps)
    if allowed is not None and name not in allowed:
        listed = ", ".join(sorted(allowed))
        reason = f"not allowed by {ALLOWED_ENV} (allowed: {listed})"
        return BackendStatus(name, False, reason, allowed=False, provider=provider, target=target), None
    if len(eps) > 1:
        # Two distributions claim the name: loading either could run code the
        # operator did not mean to, so neither is used until one is removed.
        reason = f"registered by more than one distribution ({provider or target}); uninstall all but one"
        return BackendStatus(name, False, reason, provider=provider, target=target), None

    def status(reason: str | None, kind: str = "engine") -> BackendStatus:
        return BackendStatus(name, reason is None, reason, provider=provider, target=target, kind=kind)

    try:
        cls = eps[0].load()
    except Exception as exc:  # a plugin that fails to import is unavailable, not fatal
        return status(f"failed to import {eps[0].value}: {type(exc).__name__}: {exc}"), None
    if not callable(getattr(cls, "probe", None)):
        return status(f"{eps[0].value} is not a backend class (it has no probe())"), None
    try:
        reason = cls.probe()
    except Exception as exc:  # a broken probe says so instead of taking the caller down
        return status(f"probe() raised {type(exc).__name__}: {exc}"), None
    kind = backend_kind(cls)
    if reason is not None:
        return status(str(reason) or "probe() gave no reason", kind), None
    return status(None, kind), cls


def _resolve_auto(
    priority: Sequence[str] | None, allowed: frozenset[str] | None
) -> tuple[BackendStatus, type[Backend] | None]:
    chain = configured_priority(priority)
    tried: list[str] = []
    for candidate in chain:
        status, cls = _check(candidate, allowed)
        if cls is not None and status.kind == "remote":
            # A remote backend needs an upstream to serve from; "auto" only picks where weights run.
            tried.append(f"{candidate}: a remote backend, only for models with an upstream")
            continue
        if cls is not None:
            return status, cls
        tried.append(f"{candidate}: {status.reason}")
    detail = "; ".join(tried) if tried else "the chain is empty"
    reason = f"no backend in the priority chain ({', '.join(chain)}) can run here ({detail})"
    return BackendStatus(AUTO, False, reason), None


def probe(
    name: str, *, priority: Sequence[str] | None = None, allowed: Iterable[str] | None = None
) -> BackendStatus:
    """Whether ``name`` (or ``auto``: the chain's choice) can run here, and why not.

    For ``auto`` the status carries the chosen backend's provider and target and
    the name ``auto``; ``resolve`` gives the chosen name.
    """
    allow = _allowed(allowed)
    if name == AUTO:
        status, _ = _resolve_auto(priority, allow)
        return BackendStatus(AUTO, status.available, status.reason, True, status.provider, status.target)
    return _check(name, allow)[0]


def statuses(
    *, priority: Sequence[str] | None = None, allowed: Iterable[str] | None = None
) -> list[BackendStatus]:
    """Every discovered backend, and every name in the chain: chain order first, then by name."""
    allow = _allowed(allowed)
    chain = configured_priority(priority)
    names = list(chain) + [n for n in backend_names() if n not in chain]
    return [_check(n, allow)[0] for n in names]


def resolve(
    name: str, *, priority: Sequence[str] | None = None, allowed: Iterable[str] | None = None
) -> tuple[str, type[Backend]]:
    """The backend to use for ``name``: ``(resolved name, class)``.

    ``auto`` takes the first allowed, available backend of the priority chain.
    Raises BackendError saying why when nothing (or the named backend) can run.
    """
    allow = _allowed(allowed)
    if name == AUTO:
        status, cls = _resolve_auto(priority, allow)
        if cls is None:
            raise BackendError(str(status.reason))
        return status.name, cls
    if name not in _discover():
        known = ", ".join(backend_names()) or "none"
        raise BackendError(f"unknown backend {name!r} (installed: {known}; or {AUTO!r} for the priority chain)")
    status, cls = _check(name, allow)
    if cls is None:
        raise BackendError(f"backend {name!r} cannot be used here: {status.reason}")
    return name, cls


def get_backend(
    name: str, *, priority: Sequence[str] | None = None, allowed: Iterable[str] | None = None
) -> type[Backend]:
    """The class ``name`` resolves to; raises BackendError saying why it cannot run."""
    return resolve(name, priority=priority, allowed=allowed)[1]
