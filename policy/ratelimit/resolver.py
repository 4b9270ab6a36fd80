"""From the store's ``rate_limit`` and ``quota`` policies to one principal's effective limits.

Two sets of counters apply to every request: the tenant's (shared by all its
keys and users) and the caller's own (its API key, or its OIDC subject). Each
limit is resolved on its own, most specific policy first:

* the tenant's counters: the tenant's tenant-scoped policies, else the global ones;
* the caller's counters: key-scoped policies naming the caller, else the
  tenant's ``per_key`` defaults, else the global ``per_key`` defaults.

A limit absent at one level is inherited from the next; null stops the search
(unlimited). Several policies setting the same limit at the same level: the
strictest number wins. Disabled policies count for nothing.

The scheduling fields resolve the same way into ``Scheduling``: the priority
bounds from the caller's key-scoped policies, else the tenant's, else the global
ones; the weight from the tenant's, else the global ones. The strictest wins
within a level: the highest ``min_priority``, the lowest ``max_priority`` and
``weight``. Should the bounds cross (levels set one each), ``min_priority`` wins.

``PolicyResolver`` caches the compiled policies per tenant and drops them
when the store's ``policy_version`` moves, so an edit takes effect on every
replica within about one poll interval, without a restart. While the store is
unreachable the limits last read keep serving for the shared stale window
(``policy.snapshot``), a tenant's whose version moved just before included;
past it, or for a tenant never loaded, ``StoreUnavailable``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from inferflux.policy.bounded import remember
from inferflux.policy.errors import PolicyUnusable, StoreUnavailable, ValidationFailed
from inferflux.policy.ratelimit.spec import (
    KINDS,
    LIMIT_FIELDS,
    MAX_PRIORITY,
    MIN_PRIORITY,
    PRIORITY_LIMIT,
    WEIGHT,
    LimitPolicy,
    parse_spec,
)
from inferflux.policy.rbac import Principal
from inferflux.policy.snapshot import StoreSnapshot

if TYPE_CHECKING:
    from inferflux.policy.store import PolicyRecord, PolicyStore

log = logging.getLogger("inferflux.policy.ratelimit")

PAGE = 200
MAX_SUBJECTS = 10_000  # callers' resolved limits kept per tenant


@dataclass(frozen=True, slots=True)
class Limits:
    """One set of counters' limits; None means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    spend_micros_per_month: int | None = None
    budget_tokens_per_month: int | None = None

    @property
    def unlimited(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))


@dataclass(frozen=True, slots=True)
class Scheduling:
    """How the engine may rank a caller's requests: the priorities it may ask
    for (lower is more important) and its tenant's share of the batch."""

    min_priority: int = 0
    max_priority: int = PRIORITY_LIMIT
    weight: float = 1.0

    def allows(self, priority: int) -> bool:
        return self.min_priority <= priority <= self.max_priority

    @property
    def default_priority(self) -> int:
        """The priority of a request that asks for none: 0 where allowed, else the nearest bound."""
        return min(max(0, self.min_priority), self.max_priority)


DEFAULT_SCHEDULING = Scheduling()


@dataclass(frozen=True, slots=True)
class EffectiveLimits:
    """What applies to one request: the tenant's shared counters and the caller's own, and its scheduling."""

    tenant: Limits = Limits()
    key: Limits = Limits()
    scheduling: Scheduling = DEFAULT_SCHEDULING

    @property
    def unlimited(self) -> bool:
        return self.tenant.unlimited and self.key.unlimited


UNLIMITED = EffectiveLimits()


def subject_ids(principal: Principal) -> frozenset[str]:
    """The names a key-scoped policy may use for this caller: its key id and its subject."""
    return frozenset(name for name in (principal.key_id, principal.subject) if name)


def _resolve(levels: Sequence[Sequence[Mapping[str, int | None]]]) -> Limits:
    values: dict[str, int | None] = {}
    for name in LIMIT_FIELDS:
        for level in levels:
            found = [limits[name] for limits in level if name in limits]
            if found:
                numbers = [v for v in found if v is not None]
                values[name] = min(numbers) if numbers else None
                break
    return Limits(**values)


# How several policies at one level combine each scheduling field: the strictest wins.
_STRICTEST = {MIN_PRIORITY: max, MAX_PRIORITY: min, WEIGHT: min}


def _resolve_scheduling(levels: Sequence[Sequence[Mapping[str, int | float]]]) -> Scheduling:
    values: dict[str, int | float] = {}
    for name, strictest in _STRICTEST.items():
        for level in levels:
            found = [given[name] for given in level if name in given]
            if found:
                values[name] = strictest(found)
                break
    if not values:
        return DEFAULT_SCHEDULING
    low = int(values.get(MIN_PRIORITY, DEFAULT_SCHEDULING.min_priority))
    high = max(low, int(values.get(MAX_PRIORITY, DEFAULT_SCHEDULING.max_priority)))  # crossed: min wins
    return Scheduling(low, high, float(values.get(WEIGHT, DEFAULT_SCHEDULING.weight)))


class TenantLimits:
    """One tenant's policies (its own and the global ones), compiled for quick lookups."""

    def __init__(
        self, tenant: Iterable[LimitPolicy], global_: Iterable[LimitPolicy], unusable: str | None = None
    ) -> None:
        tenant, global_ = list(tenant), list(global_)
        self.unusable = unusable  # why a stored policy of this tenant's view cannot be used, if one cannot
        own = [p for p in tenant if p.scope == "tenant"]
        self.tenant = _resolve([[p.limits for p in own], [p.limits for p in global_]])
        self._defaults = [[p.per_key for p in own], [p.per_key for p in global_]]
        self._scheduling = [[p.scheduling for p in own], [p.scheduling for p in global_]]
        self._by_principal: dict[str, list[LimitPolicy]] = {}
        for policy in tenant:
            if policy.scope == "key" and policy.principal is not None:
                self._by_principal.setdefault(policy.principal, []).append(policy)
        # Resolved per caller on first sight: the same callers come back on every request.
        self._subjects: dict[frozenset[str], EffectiveLimits] = {}

    def for_subject(self, ids: frozenset[str]) -> EffectiveLimits:
        if self.unusable is not None:
            raise PolicyUnusable(self.unusable)
        found = self._subjects.get(ids)
        if found is None:
            own = [policy for name in ids for policy in self._by_principal.get(name, ())]
            limits = _resolve([[p.limits for p in own], *self._defaults])
            scheduling = _resolve_scheduling([[p.scheduling for p in own], *self._scheduling])
            found = remember(self._subjects, ids, EffectiveLimits(self.tenant, limits, scheduling), MAX_SUBJECTS)
        return found


def compile_policies(records: Iterable[PolicyRecord], tenant_id: str) -> TenantLimits:
    """Compile ``tenant_id``'s view of ``records`` (others' records are ignored).

    A stored spec that does not validate (written around the admin API, or by an
    older version) fails closed: the tenant's requests are refused with 503
    ``policy_unusable`` naming it, rather than running without the limit it was
    meant to set, until an admin fixes or deletes it (the admin API still lists it).
    """
    tenant: list[LimitPolicy] = []
    global_: list[LimitPolicy] = []
    unusable: str | None = None
    for record in records:
        if not record.enabled or record.kind not in KINDS or record.tenant_id not in (tenant_id, None):
            continue
        try:
            policy = parse_spec(record.kind, record.spec, is_global=record.tenant_id is None)
        except ValidationFailed as exc:
            log.error("cannot use %s policy %s (%s): %s", record.kind, record.id, record.name, exc.message)
            unusable = unusable or (
                f"The {record.kind} policy {record.name!r} ({record.id}) cannot be used: {exc.message}; "
                "an admin must fix or delete it"
            )
            continue
        (global_ if record.tenant_id is None else tenant).append(policy)
    return TenantLimits(tenant, global_, unusable)


def effective_limits(records: Iterable[PolicyRecord], principal: Principal) -> EffectiveLimits:
    """The limits ``records`` put on ``principal`` (the uncached core of ``PolicyResolver``)."""
    return compile_policies(records, principal.tenant_id).for_subject(subject_ids(principal))


class PolicyResolver:
    """Effective limits from the policy store, cached per tenant until ``policy_version`` moves.

    The version is polled at most every ``poll_interval`` seconds, by the
    first request after the interval (or by ``refresh``, which the gateway may
    call from its own poller). Store calls run on a worker thread. Where another
    poller reads the version anyway (the gateway's authenticator), it hands each
    reading to ``observe``: requests then never wait for a poll, and the resolver
    polls itself only if those readings stop for two intervals.
    """

    def __init__(
        self,
        store: PolicyStore,
        *,
        poll_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        snapshot: StoreSnapshot | None = None,
    ) -> None:
        self.store = store
        self.snapshot = snapshot if snapshot is not None else StoreSnapshot()
        self.poll_interval = poll_interval
        self._clock = clock
        self._tenants: dict[str, TenantLimits] = {}
        # Each tenant's limits as last read, kept across version changes: what serves while the
        # store is unreachable, even when the version moved just before (the window counts from
        # the last successful read, not the last write). Bounded by the tenants served.
        self._snapshot: dict[str, TenantLimits] = {}
        self._version: int | None = None
        self._polled_at = float("-inf")
        self._observed = False  # fed by observe(): poll only when its readings stop
        # Bumped when the cache is dropped: a load that began before is not cached.
        self._generation = 0

    async def limits_for(self, principal: Principal) -> EffectiveLimits:
        """The limits on ``principal``; StoreUnavailable (503) only if they cannot be read at all."""
        await self._maybe_poll()
        compiled = self._tenants.get(principal.tenant_id)
        if compiled is None:
            generation = self._generation
            try:
                compiled = await asyncio.to_thread(self._load, principal.tenant_id)
            except StoreUnavailable:
                compiled = self._from_snapshot(principal.tenant_id)
            else:
                if generation == self._generation:
                    self._tenants[principal.tenant_id] = self._snapshot[principal.tenant_id] = compiled
        return compiled.for_subject(subject_ids(principal))

    def _from_snapshot(self, tenant_id: str) -> TenantLimits:
        """The store is unreachable: the tenant's limits as last read, within the stale window."""
        self.snapshot.failed()
        compiled = self._snapshot.get(tenant_id)
        if compiled is None or not self.snapshot.may_serve_stale():
            raise StoreUnavailable("The policy store is unavailable; retry shortly")
        return compiled

    @property
    def version(self) -> int | None:
        """The store's ``policy_version`` at the last poll (None before the first): caches of other
        policy-versioned tables (the price book) reload when it moves."""
        return self._version

    async def refresh(self, force: bool = False) -> bool:
        """Drop the cache if the store's policy changed since the last look; True if it did."""
        version = await asyncio.to_thread(self.store.policy_version)
        return self._take(version, force)

    def observe(self, version: int) -> None:
        """``version`` was read from the store just now by another poller: take it as this resolver's poll."""
        self._observed = True
        self._polled_at = self._clock()
        self._take(version)

    def _take(self, version: int, force: bool = False) -> bool:
        if not force and version == self._version:
            return False
        self._version = version
        self._tenants.clear()
        self._generation += 1
        return True

    def _load(self, tenant_id: str) -> TenantLimits:
        records: list[PolicyRecord] = []
        for kind in KINDS:
            after = None
            while True:
                page = self.store.list_policies(tenant_id, PAGE, after, kind=kind, include_global=True)
                records.extend(page.items)
                if page.next_cursor is None:
                    break
                after = page.next_cursor
        return compile_policies(records, tenant_id)

    async def _maybe_poll(self) -> None:
        now = self._clock()
        interval = self.poll_interval * (2 if self._observed else 1)
        if now - self._polled_at < interval and not self.snapshot.expired:
            return
        self._polled_at = now  # before the await: one poll per interval, not one per waiting request
        try:
            await self.refresh()
        except StoreUnavailable:
            # Keep serving cached limits within the stale window; the next interval tries again.
            self.snapshot.failed()
            if self._version is None or not self.snapshot.may_serve_stale():
                raise
            return
        self.snapshot.fresh()
