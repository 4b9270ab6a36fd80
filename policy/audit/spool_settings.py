"""What an audit spool is opened with: its directory, chain id, segment size and the bounds on its writer.

Checked when made (``SpoolConfigError``). The gateway builds one from its
``audit`` settings (``gateway.traffic``); ``Spool.open`` takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from inferflux.policy.audit.errors import SpoolConfigError
from inferflux.policy.audit.spool_files import NAME


@dataclass(frozen=True, slots=True)
class SpoolSettings:
    directory: Path
    chain_id: str | None = None  # default: "<hostname>-<random>", chosen when the spool is created
    segment_bytes: int = 64 * 1024 * 1024
    max_pending: int = 100_000  # written, not yet durable; beyond it append() refuses (503)
    retain_seconds: float = 0.0  # keep delivered segments at least this long
    # The least time between two fsyncs. 0: fsync as soon as anything is written
    # (for callers that wait for their receipt). More: each fsync covers what the
    # interval gathered, so a steady trickle of events wakes the syncer (whose
    # GIL round trips slow the request path) once per interval, not per event.
    sync_interval_seconds: float = 0.0
    # Below this much free space on the spool's file system ``health`` says
    # "disk_low", so the gateway refuses new work while events still fit (0: off).
    min_free_bytes: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.min_free_bytes, bool) or not isinstance(self.min_free_bytes, int) or self.min_free_bytes < 0:
            raise SpoolConfigError("audit spool min_free_bytes must be a non-negative integer")
        for name in ("segment_bytes", "max_pending"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpoolConfigError(f"audit spool {name} must be a positive integer")
        for name in ("retain_seconds", "sync_interval_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise SpoolConfigError(f"audit spool {name} must be a non-negative number")
        if self.chain_id is not None and not NAME.match(self.chain_id):
            raise SpoolConfigError("audit chain_id must be 1-64 characters of A-Z, a-z, 0-9, '.', '_', '-'")
