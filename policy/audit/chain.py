"""The hash chain: each spooled record names the hash of the one before it.

A record is one JSON line::

    {"chain": "<replica's chain id>", "event": {...}, "hash": "<hex>", "prev": "<hex>", "seq": 17, "v": 1}

``hash`` is SHA-256 over the canonical JSON (sorted keys, no spaces, UTF-8)
of every other field, so changing any byte of an event changes its hash, and
``prev`` ties each record to its predecessor. Each gateway replica writes its
own spool and so its own chain (``chain`` names it; ``seq`` counts from 0), and
``verify_lines`` checks every chain found in its input separately: records of
several replicas may be interleaved, as they are in a SIEM.

What verification proves: no record of a chain was changed, removed, inserted
or moved between its first and last record present. A chain whose first
records were pruned after delivery starts at the first present record (its
``prev`` is then taken on trust and reported). An unkeyed chain cannot by
itself stop someone who rewrites every record after the one they changed;
compare the last hashes with a copy delivered elsewhere (a SIEM) for that.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from inferflux.policy.digests import sha256

FORMAT_VERSION: Final = 1
GENESIS: Final = "0" * 64  # the prev of every chain's record 0
_HEX = frozenset("0123456789abcdef")


# One encoder for every record: json.dumps with these options would build a new one per call.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_json(value: Any) -> bytes:
    """The one byte encoding the chain hashes: sorted keys, no whitespace, UTF-8, no NaN."""
    return _CANONICAL.encode(value).encode()


def record_hash(chain: str, seq: int, prev: str, event: Mapping[str, Any]) -> str:
    body = {"v": FORMAT_VERSION, "chain": chain, "seq": seq, "prev": prev, "event": event}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def seal(chain: str, seq: int, prev: str, event: Mapping[str, Any]) -> dict[str, Any]:
    """The record for ``event`` at ``seq`` after a record hashed ``prev``."""
    return {
        "v": FORMAT_VERSION,
        "chain": chain,
        "seq": seq,
        "prev": prev,
        "hash": record_hash(chain, seq, prev, event),
        "event": event,
    }


def sealed_line(chain: str, seq: int, prev: str, event: Mapping[str, Any]) -> tuple[dict[str, Any], bytes]:
    """``seal``'s record and its canonical line, with the event encoded once instead of twice.

    The record's keys sort as chain, event, hash, prev, seq, v, so the line
    is the hashed body with the hash put in; ``canonical_json(record)`` is
    the same bytes (tested).
    """
    event_json = canonical_json(event)
    head = b'{"chain":' + canonical_json(chain) + b',"event":' + event_json
    seq_json = b"%d" % seq if type(seq) is int else canonical_json(seq)  # an int encodes as itself
    tail = b'"prev":' + canonical_json(prev) + b',"seq":' + seq_json + b',"v":%d}' % FORMAT_VERSION
    digest = sha256(head + b"," + tail).hexdigest()
    record = {"v": FORMAT_VERSION, "chain": chain, "seq": seq, "prev": prev, "hash": digest, "event": event}
    return record, head + b',"hash":"' + digest.encode() + b'",' + tail


def parse_record(line: bytes | str) -> dict[str, Any]:
    """One spooled line as a record whose hash matches its content; ValueError says what is wrong."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(record, dict) or record.get("v") != FORMAT_VERSION:
        raise ValueError(f"not an audit record of format version {FORMAT_VERSION}")
    chain, seq, prev, stored = record.get("chain"), record.get("seq"), record.get("prev"), record.get("hash")
    if not isinstance(chain, str) or not chain:
        raise ValueError("no chain id")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ValueError("no valid seq")
    if not _is_digest(prev) or not _is_digest(stored):
        raise ValueError("prev or hash is not a SHA-256 hex digest")
    event = record.get("event")
    if not isinstance(event, dict):
        raise ValueError("no event object")
    if record_hash(chain, seq, prev, event) != stored:
        raise ValueError("its hash does not match its content (the record was changed)")
    return record


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


@dataclass(frozen=True, slots=True)
class ChainSummary:
    chain: str
    first_seq: int
    last_seq: int
    last_hash: str
    records: int
    pruned_before: bool  # the first present record is not record 0


@dataclass(frozen=True, slots=True)
class Problem:
    """The first bad record: where it is, and what is wrong with it."""

    location: str  # "segment 00000003.jsonl line 17", "audit.jsonl line 4"
    message: str
    chain: str | None = None
    seq: int | None = None

    def __str__(self) -> str:
        where = f" (chain {self.chain}, seq {self.seq})" if self.chain is not None else ""
        return f"{self.location}{where}: {self.message}"


@dataclass(frozen=True, slots=True)
class VerifyReport:
    chains: tuple[ChainSummary, ...]
    duplicates: int  # identical re-deliveries skipped (files from at-least-once sinks)
    problem: Problem | None
    watched: Mapping[str, str] = field(default_factory=dict)  # chain -> hash of its record at the watched seq
    checkpoint: Any = None  # the signed checkpoint the tail was checked against (policy.audit.checkpoint)

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def records(self) -> int:
        return sum(c.records for c in self.chains)


@dataclass(slots=True)
class _ChainState:
    first_seq: int
    next_seq: int
    last_hash: str
    records: int = 1
    seen: dict[int, str] = field(default_factory=dict)


def verify_lines(
    lines: Iterable[tuple[str, bytes | str]], *, allow_duplicates: bool = False, watch: Mapping[str, int] | None = None
) -> VerifyReport:
    """Check every chain in ``(location, line)`` pairs; stops at the first bad record.

    ``allow_duplicates`` skips a record identical (same chain, seq and hash) to
    one already seen: what an at-least-once sink leaves after a redelivery.
    A spool never holds duplicates, so there it is off. ``watch`` names a seq
    per chain (a checkpoint's) whose record's hash the report keeps.
    """
    chains: dict[str, _ChainState] = {}
    duplicates = 0
    watch = watch or {}
    watched: dict[str, str] = {}

    def report(problem: Problem | None) -> VerifyReport:
        summaries = tuple(
            ChainSummary(name, s.first_seq, s.next_seq - 1, s.last_hash, s.records, s.first_seq != 0)
            for name, s in sorted(chains.items())
        )
        return VerifyReport(summaries, duplicates, problem, watched)

    for location, line in lines:
        try:
            record = parse_record(line)
        except ValueError as exc:
            return report(Problem(location, str(exc)))
        chain, seq, prev, digest = record["chain"], record["seq"], record["prev"], record["hash"]
        if watch.get(chain) == seq:
            watched[chain] = digest  # a record refused below ends verification anyway
        state = chains.get(chain)
        if state is None:
            if seq == 0 and prev != GENESIS:
                return report(Problem(location, "record 0 does not start from the genesis hash", chain, seq))
            chains[chain] = _ChainState(seq, seq + 1, digest, seen={seq: digest} if allow_duplicates else {})
            continue
        if seq == state.next_seq:
            if prev != state.last_hash:
                return report(Problem(location, "prev does not match the hash of the record before it "
                                      "(a record was inserted, replaced or moved)", chain, seq))  # fmt: skip
            state.next_seq, state.last_hash, state.records = seq + 1, digest, state.records + 1
            if allow_duplicates:
                state.seen[seq] = digest
        elif seq < state.next_seq:
            if allow_duplicates and state.seen.get(seq) == digest:
                duplicates += 1
                continue
            return report(Problem(location, f"seq {seq} comes after seq {state.next_seq - 1} "
                                  "(a record was inserted or moved)", chain, seq))  # fmt: skip
        else:
            missing = f"{state.next_seq}" if seq == state.next_seq + 1 else f"{state.next_seq} to {seq - 1}"
            return report(Problem(location, f"seq {missing} missing before this record (removed)", chain, seq))
    return report(None)
