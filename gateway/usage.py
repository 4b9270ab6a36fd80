"""The gateway's side of usage and budgets: model prices for the limiter, and budget alerts on the audit trail.

``PriceBook`` caches the store's price table and reloads it when the store's
``policy_version`` moves (price writes bump it), as the limit resolver does, so a
price set through any replica prices every replica's next requests within a poll.

``BudgetAlerts`` receives the limiter's ``BudgetCrossing``s (50, 80 and 100 % of
a budget, reported once per process) and writes each as one audit event across
all replicas: the first replica to insert the ``budget_alerts`` row of the
counter's period and threshold records the event, so it reaches the SIEM once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from inferflux.policy.audit import AuditTrail
from inferflux.policy.audit.events import AuditEvent, admin_event
from inferflux.policy.errors import ApiError, StoreUnavailable
from inferflux.policy.ratelimit import BudgetCrossing, Dimension
from inferflux.policy.usage.cost import Price, format_usd
from inferflux.policy.usage.store import UsageStore

log = logging.getLogger("inferflux.gateway.usage")

BUDGET_PRINCIPAL = "system:budgets"


class PriceBook:
    """Model prices, cached until ``version()`` (the store's policy version as last polled) moves."""

    def __init__(self, usage: UsageStore, version: Callable[[], int | None]) -> None:
        self.usage = usage
        self._version = version
        self._prices: dict[str, Price] | None = None
        self._loaded_at: int | None = None

    def invalidate(self) -> None:
        self._prices = None

    async def price_for(self, model: str) -> Price | None:
        version = self._version()
        if self._prices is None or version != self._loaded_at:
            try:
                records = await asyncio.to_thread(self.usage.prices)
                self._prices = {name: record.price for name, record in records.items()}
                self._loaded_at = version
            except StoreUnavailable:
                if self._prices is None:
                    raise  # never loaded: the request cannot be priced (503)
                log.warning("model prices could not be reloaded; the cached ones price requests meanwhile")
        return self._prices.get(model)


class BudgetAlerts:
    """The limiter's ``on_budget``: each crossing becomes one audit event across replicas."""

    def __init__(self, usage: UsageStore) -> None:
        self.usage = usage
        self.trail: AuditTrail | None = None  # set when the trail starts
        self._tasks: set[asyncio.Task[None]] = set()

    def __call__(self, crossing: BudgetCrossing) -> None:
        task = asyncio.ensure_future(self._record(crossing))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _record(self, crossing: BudgetCrossing) -> None:
        try:
            if self.trail is None or not await asyncio.to_thread(
                self.usage.claim_alert, crossing.counter, crossing.threshold
            ):
                return
            await self.trail.record(alert_event(crossing))
        except (ApiError, OSError) as exc:
            log.error("budget alert %s %d%% not recorded: %s", crossing.counter, crossing.threshold, exc)


def alert_event(crossing: BudgetCrossing) -> AuditEvent:
    spend = crossing.dimension is Dimension.SPEND
    money = format_usd if spend else str
    period = crossing.counter.rsplit(":", 1)[-1]
    return admin_event(
        principal=BUDGET_PRINCIPAL,
        action="budget.threshold",
        target_kind="budget",
        target_id=f"{crossing.level.value}:{'spend' if spend else 'tokens'}",
        tenant_id=crossing.tenant_id,
        detail={
            "threshold_percent": crossing.threshold,
            "budget": "spend_usd" if spend else "tokens",
            "scope": crossing.level.value,
            "principal": crossing.subject,
            "period": period,
            "limit": money(crossing.limit),
            "used": money(crossing.used),
        },
    )
