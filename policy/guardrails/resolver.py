"""A tenant's effective guardrails from the policy store, cached per policy version.

The effective guardrails of a tenant are every enabled ``guardrail`` policy that
is global (``tenant_id`` None) or the tenant's own. They are compiled once per
store ``policy_version`` and tenant; the version is read at most once per
``poll_seconds`` (each replica polls, as authentication does), so an edit made
over the admin API takes effect within about that interval, without a restart.
An embedded OPA policy whose Rego and query did not change is not recompiled.
A global policy's embedded Rego is evaluated inline (``policy.guardrails.opa``):
only platform admins write global policies, so it is the operator's own code.

While the store is unreachable the guardrails last compiled keep serving for
the shared stale window (``policy.snapshot``), a tenant's whose version moved
just before included; a tenant never compiled, or any tenant once the window
has passed, gets ``StoreUnavailable`` (503).

A stored policy that no longer validates or compiles fails closed: its tenant's
requests get ``GuardrailMisconfigured`` (503 ``policy_unusable``, naming the
policy and its id) until it is fixed or deleted, and the log names it too.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from inferflux.policy.errors import StoreUnavailable, ValidationFailed
from inferflux.policy.guardrails.engine import Guardrails
from inferflux.policy.guardrails.errors import GuardrailMisconfigured
from inferflux.policy.guardrails.opa import EmbeddedRego, PolicyEngine, build_engine
from inferflux.policy.guardrails.spec import KIND, GuardrailSpec, OpaSettings, parse_spec
from inferflux.policy.snapshot import StoreSnapshot

if TYPE_CHECKING:
    from inferflux.policy.store import PolicyRecord, PolicyStore

log = logging.getLogger("inferflux.guardrails")

PAGE = 200


def _engine_key(name: str, settings: OpaSettings, inline: bool) -> str:
    # Includes the token, hashed, so a changed token builds a new client without keeping the token in a key.
    material = repr((name, settings.engine, settings.rego, settings.query, settings.url, settings.path))
    material += repr((settings.timeout_ms, settings.fail_open, settings.token, inline))
    return hashlib.sha256(material.encode()).hexdigest()


class GuardrailResolver:
    """``resolve(tenant_id)`` -> the tenant's compiled ``Guardrails``, refreshed when the store's version moves."""

    def __init__(
        self,
        store: PolicyStore,
        *,
        poll_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        snapshot: StoreSnapshot | None = None,
    ) -> None:
        self._store = store
        self.snapshot = snapshot if snapshot is not None else StoreSnapshot()
        self._poll = poll_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._version: int | None = None
        self._checked_at = float("-inf")
        self._observed = False  # fed by observe(): poll only when its readings stop
        self._cache: dict[str | None, Guardrails] = {}
        # Each tenant's guardrails as last compiled, kept across version changes: what serves while
        # the store is unreachable, even when the version moved just before (the window counts from
        # the last successful read, not the last write). Bounded by the tenants served.
        self._snapshot: dict[str | None, Guardrails] = {}
        # OPA engines by what they were built from. At each version change the
        # current ones retire: those the new version still uses are taken back as
        # tenants are compiled again, and those still retired at the next change are
        # let go (a remote one is kept until ``aclose``, which closes its session).
        # So edits do not pile up compiled policies.
        self._engines: dict[str, PolicyEngine] = {}
        self._retired: dict[str, PolicyEngine] = {}
        self._to_close: list[PolicyEngine] = []

    def observe(self, version: int) -> None:
        """``version`` was read from the store just now by another poller (the gateway's authenticator):
        take it as this resolver's poll, so requests find their tenant cached instead of waiting for one;
        the resolver polls itself only if those readings stop for two intervals."""
        with self._lock:
            self._observed = True
            self._take(version, self._clock())

    def _take(self, version: int, now: float) -> None:
        """A fresh reading of the store's version (lock held): drop what an older version compiled."""
        if version != self._version:
            self._cache.clear()
            self._retire()
            self._version = version
        self._checked_at = now

    def _due(self, now: float) -> bool:
        """Whether the version must be read before answering from the cache."""
        interval = self._poll * (2 if self._observed else 1)
        return self._version is None or now - self._checked_at >= interval or self.snapshot.expired

    def _current_version(self) -> int:
        now = self._clock()
        if self._due(now):
            try:
                version = self._store.policy_version()
            except StoreUnavailable:
                self.snapshot.failed()
                if self._version is None or not self.snapshot.may_serve_stale():
                    raise
                self._checked_at = now  # one attempt per poll interval; the others serve the snapshot
                return self._version
            self.snapshot.fresh()
            with self._lock:
                self._take(version, now)
        return self._version if self._version is not None else -1

    def cached(self, tenant_id: str | None) -> Guardrails | None:
        """The tenant's guardrails if cached and the version need not be read yet; never touches the store."""
        if self._due(self._clock()):
            return None
        return self._cache.get(tenant_id)

    def get(self, tenant_id: str | None) -> Guardrails:
        """The tenant's guardrails (blocking: may read the store). None: the global policies alone."""
        version = self._current_version()
        hit = self._cache.get(tenant_id)
        if hit is not None:
            return hit
        try:
            records = self._records(tenant_id)
        except StoreUnavailable:
            return self._from_snapshot(tenant_id)
        guardrails = self._compile(records)
        with self._lock:
            if self._version == version:
                self._cache[tenant_id] = self._snapshot[tenant_id] = guardrails
        return guardrails

    def _from_snapshot(self, tenant_id: str | None) -> Guardrails:
        """The store is unreachable: the tenant's guardrails as last compiled, within the stale window."""
        self.snapshot.failed()
        with self._lock:
            snapshot = self._snapshot.get(tenant_id)
        if snapshot is None or not self.snapshot.may_serve_stale():
            raise StoreUnavailable("The policy store is unavailable; retry shortly")
        return snapshot

    async def resolve(self, tenant_id: str | None) -> Guardrails:
        """``get`` for the event loop: the cached answer at once, else the store on a worker thread."""
        hit = self.cached(tenant_id)
        return hit if hit is not None else await asyncio.to_thread(self.get, tenant_id)

    def _retire(self) -> None:
        """The version moved (lock held): retire the current engines, let go of those retired before."""
        self._to_close += [engine for engine in self._retired.values() if not isinstance(engine, EmbeddedRego)]
        self._retired, self._engines = self._engines, {}

    @property
    def held_engines(self) -> int:
        """OPA engines this resolver keeps (current and retired): bounded however often policies change."""
        with self._lock:
            return len(self._engines) + len(self._retired)

    def invalidate(self) -> None:
        """Forget every compiled tenant (the next call reads the store)."""
        with self._lock:
            self._cache.clear()
            self._version = None

    async def aclose(self) -> None:
        """Close every OPA client this resolver built (at shutdown; the guardrails it handed out share them)."""
        with self._lock:
            engines = [*self._engines.values(), *self._retired.values(), *self._to_close]
            self._engines, self._retired, self._to_close = {}, {}, []
            self._cache.clear()
            self._snapshot.clear()
            self._version = None
        for engine in engines:
            await engine.aclose()

    def _reclaim(self, key: str) -> PolicyEngine | None:
        with self._lock:
            return self._retired.pop(key, None)

    def _records(self, tenant_id: str | None) -> list[PolicyRecord]:
        out: list[PolicyRecord] = []
        after = None
        while True:
            page = self._store.list_policies(tenant_id, PAGE, after, kind=KIND, include_global=True)
            out.extend(record for record in page.items if record.enabled)
            if page.next_cursor is None:
                return out
            after = page.next_cursor

    def _compile(self, records: list[PolicyRecord]) -> Guardrails:
        specs: list[GuardrailSpec] = []
        engines: list[PolicyEngine] = []
        live: dict[str, PolicyEngine] = {}
        for record in records:
            try:
                spec = parse_spec(record.spec, record.sensitive_spec, name=record.name)
                if spec.opa is not None:
                    # A global policy is the operator's own (only platform admins write
                    # them), so its embedded Rego may run inline on the event loop.
                    inline = record.tenant_id is None
                    key = _engine_key(record.id, spec.opa, inline)
                    engine = self._engines.get(key) or self._reclaim(key) or build_engine(
                        record.name, spec.opa, inline=inline
                    )
                    live[key] = engine
                    engines.append(engine)
            except Exception as exc:  # ValidationFailed, OpaError, or what an older version let through
                raise _unusable(record, exc) from None
            specs.append(spec)
        with self._lock:
            self._engines.update(live)
        try:
            return Guardrails(specs, engines)
        except Exception as exc:
            # Name the policy that cannot be compiled on its own (the first, if none alone fails).
            culprit = next((r for r, s in zip(records, specs, strict=True) if not _compiles(s)), records[0])
            raise _unusable(culprit, exc) from None


def _compiles(spec: GuardrailSpec) -> bool:
    try:
        Guardrails([spec], engines=())
    except Exception:
        return False
    return True


def _unusable(record: PolicyRecord, exc: Exception) -> GuardrailMisconfigured:
    """A stored policy that cannot be used: its tenant's requests fail closed (503) until an admin fixes it."""
    detail = exc.message if isinstance(exc, ValidationFailed) else type(exc).__name__  # never a rule's text
    log.error("guardrail policy %s (%r) cannot be used and fails closed: %s", record.id, record.name, detail)
    return GuardrailMisconfigured(
        f"The guardrail policy {record.name!r} ({record.id}) cannot be used ({detail}); "
        "an administrator must fix or delete it"
    )
