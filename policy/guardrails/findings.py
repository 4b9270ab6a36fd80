"""What a check reports: findings (type, span, rule; never the matched text) and the matchers behind them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Action(StrEnum):
    """What a rule does when it matches; the strictest wins when policies overlap."""

    LOG = "log"  # record a finding, change nothing
    REDACT = "redact"  # replace the span with a typed placeholder
    BLOCK = "block"  # refuse the request, or end the stream with finish_reason "content_filter"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Action.LOG: 0, Action.REDACT: 1, Action.BLOCK: 2}


class Direction(StrEnum):
    INPUT = "input"
    OUTPUT = "output"
    BOTH = "both"

    def covers(self, direction: Direction) -> bool:
        return self is Direction.BOTH or self is direction


@dataclass(frozen=True, slots=True)
class Hit:
    """A match in normalised text: ``[start, end)``.

    ``settled`` is where the match becomes certain (its end, except for a private
    key, which is certain once its BEGIN line is complete); ``closed`` is False
    while the span may still grow (a private key whose END line has not come).
    """

    start: int
    end: int
    settled: int
    closed: bool = True


# A finder yields the hits of one detector in a normalised text.
Finder = Callable[[str], Iterator[Hit]]


@dataclass(frozen=True, slots=True)
class Matcher:
    """One compiled rule: how to find it, what to do, and how much text a stream must hold back for it."""

    rule: str  # "pii.email", "blocklist.<id>"
    kind: str  # "pii" | "blocklist"
    type: str  # "email", "phone", ... or "blocklist"
    action: Action
    placeholder: str
    find: Finder
    max_length: int  # longest match (normalised characters) before it is settled
    spaces: bool  # whether a match may contain a space (else it lies within one word)
    policy: str = ""  # the policy it came from, for reasons and audit
    literal: str | None = None  # a blocklist literal found by plain string search: it may share a gate


@dataclass(frozen=True, slots=True)
class Finding:
    """A rule that fired: safe to log and audit, since it never carries the matched text.

    ``index`` is which of the checked texts it is in; ``start``/``end`` are
    offsets in that (original) text.
    """

    rule: str
    kind: str
    type: str
    action: Action
    policy: str
    index: int
    start: int
    end: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "kind": self.kind,
            "type": self.type,
            "action": self.action.value,
            "policy": self.policy,
            "index": self.index,
            "start": self.start,
            "end": self.end,
        }

    def reason(self) -> str:
        """Which rule fired, in words, without the content."""
        what = f"{self.type} detected" if self.kind == "pii" else "a blocklisted term"
        where = f" (policy '{self.policy}')" if self.policy else ""
        return f"{what}: rule '{self.rule}'{where}"
