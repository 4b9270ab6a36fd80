"""Tamper-evident audit: events, hash chain, durable spool, SIEM sinks, live tail, store index.

``AuditTrail`` (``policy.audit.trail``) wires the parts below together. The
flow, all off the request path except the seal and the write::

    event = api_event(...) / admin_event(...)      policy.audit.events
    receipt = spool.append(event)                  seal (chain) and write, on the caller's thread
    await receipt                                  (wait_durable only) resolves once fsynced
    syncer thread ─ fsync, one per batch           policy.audit.spool, .chain
        ├─ LiveTail.publish (SSE subscribers)      policy.audit.tail
        └─ Delivery per sink, own cursor, retry    policy.audit.delivery
             FileSink, SyslogSink, HttpSink        policy.audit.sinks
             IndexerSink → audit_events table      policy.audit.store

The gateway answers a request only after its event is written to the spool,
so "acknowledged" means "in the kernel": a ``kill -9`` of the gateway loses no
answered request's event, and sinks deliver it after the restart
(at-least-once, de-duplicated by event id). With ``audit.wait_durable`` it also
waits for the receipt, so "acknowledged" means "on disk" and a crash of the
machine loses none either; group commit keeps that as cheap as a disk flush.

Names are imported on first use, so ``inferctl --help`` does not load them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferflux.policy.lazy import lazy_exports

if TYPE_CHECKING:
    from inferflux.policy.audit.chain import Problem, VerifyReport, verify_lines
    from inferflux.policy.audit.cli import add_audit_parser, verify_files, verify_spool
    from inferflux.policy.audit.delivery import Backoff, Delivery, Sink
    from inferflux.policy.audit.errors import (
        AuditUnavailable,
        ChainConflict,
        InvalidAuditEvent,
        SinkError,
        SpoolConfigError,
        TooManySubscriptions,
    )
    from inferflux.policy.audit.events import AuditEvent, ContentDigester, Finding, admin_event, api_event
    from inferflux.policy.audit.sinks.file import FileSink
    from inferflux.policy.audit.sinks.http import HttpSink
    from inferflux.policy.audit.sinks.syslog import SyslogSink
    from inferflux.policy.audit.spool import Cursor, Receipt, Spool, SpooledRecord
    from inferflux.policy.audit.spool_settings import SpoolSettings
    from inferflux.policy.audit.store import AuditRecord, AuditStore, IndexerSink
    from inferflux.policy.audit.store import Retention
    from inferflux.policy.audit.tail import Dropped, LiveTail, Subscription, sse_message
    from inferflux.policy.audit.trail import AuditTrail

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "inferflux.policy.audit.chain": ("Problem", "VerifyReport", "verify_lines"),
        "inferflux.policy.audit.cli": ("add_audit_parser", "verify_files", "verify_spool"),
        "inferflux.policy.audit.delivery": ("Backoff", "Delivery", "Sink"),
        "inferflux.policy.audit.errors": (
            "AuditUnavailable",
            "ChainConflict",
            "InvalidAuditEvent",
            "SinkError",
            "SpoolConfigError",
            "TooManySubscriptions",
        ),
        "inferflux.policy.audit.events": ("AuditEvent", "ContentDigester", "Finding", "admin_event", "api_event"),
        "inferflux.policy.audit.sinks.file": ("FileSink",),
        "inferflux.policy.audit.sinks.http": ("HttpSink",),
        "inferflux.policy.audit.sinks.syslog": ("SyslogSink",),
        "inferflux.policy.audit.spool": ("Cursor", "Receipt", "Spool", "SpooledRecord"),
        "inferflux.policy.audit.spool_settings": ("SpoolSettings",),
        "inferflux.policy.audit.store": ("AuditRecord", "AuditStore", "IndexerSink", "Retention"),
        "inferflux.policy.audit.tail": ("Dropped", "LiveTail", "Subscription", "sse_message"),
        "inferflux.policy.audit.trail": ("AuditTrail",),
    },
)
