"""Traffic policy for the gateway: rate limits, guardrails and the audit trail, built from settings.

``TrafficPolicy.build`` makes the three parts from ``Settings`` and the policy
store; the app starts them in its lifespan and closes them at shutdown. The
request path uses them through ``gateway.pipeline.policy.RequestPolicy`` (limits, guardrails)
and ``AuditMiddleware`` (one event per tenant API call).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inferflux.policy.audit import (
    AuditStore,
    AuditTrail,
    ContentDigester,
    FileSink,
    HttpSink,
    IndexerSink,
    Retention,
    Spool,
    SpoolSettings,
    SyslogSink,
)
from inferflux.policy.audit.checkpoint import CHECKPOINT_PURPOSE, Checkpointer, CheckpointSigner
from inferflux.policy.audit.refusals import RefusalAggregator
from inferflux.policy.errors import StoreUnavailable
from inferflux.policy.guardrails import GuardrailResolver
from inferflux.policy.ratelimit import MemoryBackend, PolicyResolver, RateLimiter
from inferflux.policy.snapshot import StoreSnapshot
from inferflux.policy.usage.store import UsageStore

from inferflux.gateway.usage import BudgetAlerts, PriceBook

if TYPE_CHECKING:
    from inferflux.policy.audit.delivery import Sink
    from inferflux.policy.store import PolicyStore

    from inferflux.gateway.settings import AuditSinkSettings, Settings

log = logging.getLogger(__name__)

# The HMAC key of prompt and completion digests in audit events.
AUDIT_CONTENT_PURPOSE = "audit-content"


@dataclass
class TrafficPolicy:
    limiter: RateLimiter
    guardrails: GuardrailResolver
    audit_store: AuditStore
    digester: ContentDigester
    retention: Retention
    spool_settings: SpoolSettings
    sinks: list[Sink]
    wait_durable: bool
    sink_linger_seconds: float = 0.0
    refusal_aggregation_seconds: float = 10.0
    checkpoint_signer: CheckpointSigner | None = None  # None: no checkpoints
    checkpoint_every_events: int = 1000
    checkpoint_interval_seconds: float = 60.0
    # Opened by start(): the spool takes a lock on its directory, so an app
    # that is built but never started holds none.
    audit_trail: AuditTrail | None = None
    # Usage and budgets (gateway/usage.py), over the audit store's database.
    usage: UsageStore = field(init=False)
    prices: PriceBook = field(init=False)
    budget_alerts: BudgetAlerts = field(init=False)

    def __post_init__(self) -> None:
        self.usage = UsageStore(self.audit_store.engine)
        self.prices = PriceBook(self.usage, lambda: getattr(self.limiter.limits, "version", None))
        self.budget_alerts = BudgetAlerts(self.usage)
        self.limiter.on_budget = self.budget_alerts
        self.retention.also(self.usage.prune_minutes)

    @classmethod
    def build(
        cls, settings: Settings, store: PolicyStore, *, on_limiter_failure: Any = None,
        snapshot: StoreSnapshot | None = None,
    ) -> TrafficPolicy:
        poll = settings.auth.revocation_poll_seconds
        if snapshot is None:
            snapshot = StoreSnapshot(settings.store.stale_seconds)
        rl = settings.ratelimit
        backend: Any
        if rl.backend == "redis":
            # Imported only here: the redis client is 24 MiB resident that an embedded server does not need.
            from inferflux.policy.ratelimit import RedisBackend

            backend = RedisBackend.from_url(rl.redis_url, prefix=rl.redis_prefix, timeout=rl.redis_timeout_seconds)
        else:
            backend = MemoryBackend(settings.data_dir / "ratelimit")
        limiter = RateLimiter(
            backend,
            PolicyResolver(store, poll_interval=poll, snapshot=snapshot),
            completion_estimate=rl.completion_estimate,
            fail_open=rl.fail_open,
            on_failure=on_limiter_failure,
        )
        audit = settings.audit
        audit_store = AuditStore(store.engine)  # the policy store's database, and its pool
        sinks: list[Sink] = [IndexerSink(audit_store), *(_sink(s) for s in audit.sinks)]
        digester = ContentDigester(store.derive_secret(AUDIT_CONTENT_PURPOSE), debug=audit.debug_content)
        return cls(
            limiter=limiter,
            guardrails=GuardrailResolver(store, poll_seconds=poll, snapshot=snapshot),
            audit_store=audit_store,
            digester=digester,
            retention=Retention(audit_store, audit.retention_days),
            spool_settings=SpoolSettings(
                audit.spool_dir or settings.data_dir / "audit", chain_id=audit.chain_id,
                sync_interval_seconds=0.0 if audit.wait_durable else audit.fsync_interval_seconds,
                min_free_bytes=audit.min_free_bytes,
            ),
            sinks=sinks,
            wait_durable=audit.wait_durable,
            sink_linger_seconds=audit.sink_linger_seconds,
            refusal_aggregation_seconds=audit.refusal_aggregation_seconds,
            checkpoint_signer=CheckpointSigner(store.derive_secret(CHECKPOINT_PURPOSE)),
            checkpoint_every_events=audit.checkpoint_every_events,
            checkpoint_interval_seconds=audit.checkpoint_interval_seconds,
        )

    def observe_policy_version(self, version: int) -> None:
        """The store's ``policy_version``, read just now by the authenticator's poller: the limit and
        guardrail resolvers take it as their own poll (``Authenticator.on_version``)."""
        self.limiter.limits.observe(version)
        self.guardrails.observe(version)

    async def start(self) -> AuditTrail:
        spool = await asyncio.to_thread(Spool.open, self.spool_settings)
        try:
            await asyncio.to_thread(self._check_chain, spool)
        except BaseException:
            await asyncio.to_thread(spool.close)
            raise
        checkpointer = None
        if self.checkpoint_signer is not None:
            checkpointer = Checkpointer(
                spool, self.checkpoint_signer, every_events=self.checkpoint_every_events,
                every_seconds=self.checkpoint_interval_seconds, keep=self.audit_store.add_checkpoint,
            )  # fmt: skip
        self.audit_trail = AuditTrail(
            spool, self.sinks, wait_durable=self.wait_durable, linger_seconds=self.sink_linger_seconds,
            refusals=RefusalAggregator(self.refusal_aggregation_seconds), checkpointer=checkpointer,
        ).start()  # fmt: skip
        self.budget_alerts.trail = self.audit_trail
        self.retention.start()
        await self.limiter.start()
        return self.audit_trail

    def _check_chain(self, spool: Spool) -> None:
        """ChainConflict if the store shows another spool writing this spool's chain (replicas share
        the store's audit index, one chain each); a store that does not answer now is not a reason to stop."""
        seq, digest = spool.durable_head()
        try:
            self.audit_store.check_head(spool.chain_id, seq, digest)
        except StoreUnavailable as exc:
            log.warning("could not check audit chain %s against the store's index at start: %s", spool.chain_id, exc)

    async def close(self) -> None:
        await self.limiter.close()
        await self.budget_alerts.drain()
        await self.guardrails.aclose()
        self.retention.stop()
        if self.audit_trail is not None:
            # The trail flushes the spool and stops its sinks' threads: keep the loop free.
            await asyncio.to_thread(self.audit_trail.close)


def _sink(cfg: AuditSinkSettings) -> Sink:
    # AuditSinkSettings has checked that each type's required keys are set.
    if cfg.type == "file":
        return FileSink(str(cfg.path), max_bytes=int(cfg.max_bytes), backups=cfg.backups, name=cfg.name or "file")
    if cfg.type == "syslog":
        return SyslogSink(
            str(cfg.host), int(cfg.port or 0), transport=cfg.transport, ca_file=cfg.ca_file,
            server_name=cfg.server_name, name=cfg.name,
        )
    token = None
    if cfg.token_env:
        token = os.environ.get(cfg.token_env)
        if not token:
            raise ValueError(f"audit sink {cfg.name or cfg.url}: ${cfg.token_env} is not set")
    return HttpSink(str(cfg.url), format=cfg.format, token=token, ca_file=cfg.ca_file, name=cfg.name)
