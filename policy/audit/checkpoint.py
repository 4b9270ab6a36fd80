"""Signed checkpoints: what makes a cut tail of the hash chain visible.

The hash chain (``policy.audit.chain``) proves that nothing was changed,
removed or inserted *between* the first and last records present; deleting
the last records leaves a shorter chain that verifies. A checkpoint closes
that gap: every ``audit.checkpoint_every_events`` events or
``audit.checkpoint_interval_seconds`` seconds the gateway signs the chain's
durable head::

    {"v": 1, "chain": "<chain id>", "seq": 1234, "hash": "<hash of record 1234>", "at": "...Z", "sig": "<hex>"}

``sig`` is HMAC-SHA256 over the canonical JSON of the other fields, under a
key that is not in the spool: ``PolicyStore.derive_secret("audit-checkpoint")``,
derived from the store's encrypted server secret (so whoever can edit the
spool but not decrypt the store cannot sign). The checkpoint is kept outside
the spool — in the store's ``audit_checkpoints`` table — and also written to
the chain as an event of kind ``checkpoint``, so every sink (a SIEM) holds
the signed heads too.

``check_tail`` compares a verified chain with its latest checkpoint: a chain
that ends before the checkpoint's seq lost its tail (how many records is
the difference), and a record at that seq with another hash was rewritten.
What is written after the latest checkpoint is not covered until the next
one: a cut can remove at most that much unseen.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from inferflux.policy.audit.chain import ChainSummary, Problem, canonical_json
from inferflux.policy.audit.errors import AuditUnavailable
from inferflux.policy.audit.events import checkpoint_event

if TYPE_CHECKING:
    from inferflux.policy.audit.spool import Spool

log = logging.getLogger("inferflux.policy.audit")

CHECKPOINT_VERSION: Final = 1
CHECKPOINT_PURPOSE: Final = "audit-checkpoint"  # PolicyStore.derive_secret's purpose for the signing key


@dataclass(frozen=True, slots=True)
class Checkpoint:
    chain: str
    seq: int  # the last record it covers
    hash: str  # that record's hash
    at: datetime
    sig: str

    def body(self) -> dict[str, Any]:
        """What the signature covers."""
        at = self.at.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
        return {"v": CHECKPOINT_VERSION, "chain": self.chain, "seq": self.seq, "hash": self.hash, "at": at}

    def to_json(self) -> dict[str, Any]:
        return {**self.body(), "sig": self.sig}

    def describe(self) -> str:
        return f"checkpoint of {self.body()['at']} (chain {self.chain}, seq {self.seq})"


class CheckpointSigner:
    """Signs and checks checkpoints with one HMAC-SHA256 key (at least 16 bytes)."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("the audit checkpoint key must be at least 16 bytes")
        self._key = key

    def __repr__(self) -> str:
        return "CheckpointSigner(<key>)"

    def _mac(self, body: Mapping[str, Any]) -> str:
        return hmac.new(self._key, canonical_json(body), hashlib.sha256).hexdigest()

    def sign(self, chain: str, seq: int, digest: str, at: datetime | None = None) -> Checkpoint:
        unsigned = Checkpoint(chain, seq, digest, at or datetime.now(UTC), "0" * 64)
        return Checkpoint(chain, seq, digest, unsigned.at, self._mac(unsigned.body()))

    def valid(self, checkpoint: Checkpoint) -> bool:
        return hmac.compare_digest(self._mac(checkpoint.body()), checkpoint.sig)


def check_tail(
    chain: ChainSummary | None, checkpoint: Checkpoint, hash_at_checkpoint: str | None, signer: CheckpointSigner
) -> Problem | None:
    """Whether a verified chain still reaches ``checkpoint``; the problem if it does not.

    ``chain`` is the verified chain's summary (None: no record of it present),
    ``hash_at_checkpoint`` the hash of its record at the checkpoint's seq, if
    that record is present.
    """
    where = f"end of chain {checkpoint.chain}"
    if not signer.valid(checkpoint):
        return Problem(where, f"the {checkpoint.describe()} has a signature that does not verify "
                       "(forged, or signed with another key)", checkpoint.chain, checkpoint.seq)  # fmt: skip
    if chain is None:
        return Problem(where, f"{checkpoint.seq + 1} records missing: no record of the chain is present, "
                       f"but the signed {checkpoint.describe()} covers seq 0 to {checkpoint.seq}",
                       checkpoint.chain, checkpoint.seq)  # fmt: skip
    if chain.last_seq < checkpoint.seq:
        missing = checkpoint.seq - chain.last_seq
        return Problem(where, f"{missing} records missing after seq {chain.last_seq}: the signed "
                       f"{checkpoint.describe()} covers up to seq {checkpoint.seq} (the tail was cut)",
                       checkpoint.chain, chain.last_seq + 1)  # fmt: skip
    if hash_at_checkpoint is not None and hash_at_checkpoint != checkpoint.hash:
        return Problem(where, f"the record at seq {checkpoint.seq} is not the one the signed "
                       f"{checkpoint.describe()} covers (the chain was rewritten)", checkpoint.chain,
                       checkpoint.seq)  # fmt: skip
    return None


class Checkpointer:
    """Signs the spool's durable head when one is due, keeps it outside the spool, and writes it to the chain.

    ``run_once`` is called by the trail's housekeeping thread every tick and
    once more (forced) at shutdown. A checkpoint is due when records were made
    durable since the last one and either ``every_events`` of them or
    ``every_seconds`` have passed; the checkpoint's own record never makes
    another one due, so an idle gateway writes none. ``keep`` (the store's
    ``add_checkpoint``) failing is logged; the chain's copy is written anyway.
    """

    def __init__(
        self,
        spool: Spool,
        signer: CheckpointSigner,
        *,
        every_events: int = 1000,
        every_seconds: float = 60.0,
        keep: Callable[[Checkpoint], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(every_events, bool) or not isinstance(every_events, int) or every_events < 1:
            raise ValueError("checkpoint every_events must be a positive integer")
        if isinstance(every_seconds, bool) or not isinstance(every_seconds, int | float) or every_seconds <= 0:
            raise ValueError("checkpoint every_seconds must be a positive number")
        self.spool = spool
        self.signer = signer
        self.every_events = every_events
        self.every_seconds = float(every_seconds)
        self._keep = keep
        self._clock = clock
        self._last_seq = -1  # the seq the latest checkpoint covers
        self._own_seq: int | None = None  # the seq of that checkpoint's own record
        self._last_time = clock()
        self.latest: Checkpoint | None = None

    def run_once(self, *, force: bool = False) -> Checkpoint | None:
        """Make a checkpoint if one is due (``force``: if anything is new); the checkpoint made, if any."""
        seq, digest = self.spool.durable_head()
        if seq < 0 or seq in (self._last_seq, self._own_seq):
            return None
        if not force and seq - self._last_seq < self.every_events and (
            self._clock() - self._last_time < self.every_seconds
        ):
            return None
        checkpoint = self.signer.sign(self.spool.chain_id, seq, digest)
        if self._keep is not None:
            try:
                self._keep(checkpoint)
            except Exception as exc:  # the store is down: the chain and the sinks still get it
                log.error("audit checkpoint at seq %d not stored: %s", seq, exc)
        self._last_seq, self._last_time, self.latest = seq, self._clock(), checkpoint
        try:
            receipt = self.spool.append(checkpoint_event(checkpoint.to_json()))
            if receipt.wait(5.0):
                self._own_seq = receipt.seq
        except AuditUnavailable as exc:
            log.error("audit checkpoint at seq %d not written to the chain: %s", seq, exc.message)
        return checkpoint
