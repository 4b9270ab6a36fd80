"""The audit library's errors.

``AuditUnavailable`` reaches clients: the gateway refuses a request it cannot
audit (default-deny) rather than serve it unrecorded. The others are for
operators and start-up code and never carry a secret in their message.
"""

from __future__ import annotations

from inferflux.policy.errors import PolicyError


class AuditUnavailable(PolicyError):
    """503: the audit spool cannot take the event (closed, full, or its disk failed); retryable."""

    status_code = 503
    error_type = "server_error"
    default_code = "audit_unavailable"


class TooManySubscriptions(PolicyError):
    """429: the caller's tenant holds its share of live audit subscriptions already; retry when one ends."""

    status_code = 429
    error_type = "requests"
    default_code = "too_many_subscriptions"


class InvalidAuditEvent(PolicyError):
    """500: the gateway built an event the audit model refuses (a bug, never the client's input)."""

    status_code = 500
    error_type = "server_error"
    default_code = "invalid_audit_event"


class SpoolConfigError(Exception):
    """The spool cannot be opened as configured (unwritable, locked by another process, bad setting)."""


class ChainConflict(SpoolConfigError):
    """Another spool writes this spool's chain: replicas sharing one ``audit.chain_id``, or a spool
    lost and re-created under a fixed one. Its records would collide with the other's in the store's
    index (one chain, one record per seq) and neither chain would verify."""


class SinkError(Exception):
    """A sink could not deliver a batch; the delivery loop retries it with back-off."""
