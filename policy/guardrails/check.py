"""Scanning a normalised text with a set of matchers, and rendering redactions onto the original.

One function finds, one resolves overlaps, one redacts, so the whole-text check
and the streaming check (``stream``) decide exactly alike.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from inferflux.policy.guardrails.blocklist import literal_gate
from inferflux.policy.guardrails.decode import DECODERS
from inferflux.policy.guardrails.errors import ContentFiltered
from inferflux.policy.guardrails.findings import Action, Finding, Hit, Matcher
from inferflux.policy.guardrails.normalize import Normalized, joined, normalize


@dataclass(frozen=True, slots=True)
class LiteralGroup:
    """Blocklist literals looked for together: one pass of an RE2 set (``gate``) tells which of them
    occur in a text, and only those are looked for, with their word boundaries. A tenant's list of
    words then costs one search per text that holds none of them, not one per word."""

    matchers: tuple[Matcher, ...]
    gate: Any  # re2.Set over the matchers' literals, in their order
    literals: tuple[str, ...]  # the matchers' literals, in their order

    def occurring(self, text: str) -> list[Matcher]:
        """The matchers whose literal occurs in ``text`` (in their order; none most of the time).

        A few literals in a short text are each looked for with ``in``; beyond ``PLAIN_SEARCH_BUDGET``
        characters times literals, the RE2 set's one pass (linear in the text whatever the list) is
        cheaper. Both find exact occurrences, so they agree; the plain search touches only the
        literals and the text, where the set's automaton, between two of a model's forward passes,
        is no longer in the CPU's caches (0.5 us isolated, tens in a served request)."""
        if len(text) * len(self.literals) <= PLAIN_SEARCH_BUDGET:
            return [matcher for matcher, literal in zip(self.matchers, self.literals, strict=True) if literal in text]
        found = self.gate.Match(text)
        return [] if found is None else [self.matchers[i] for i in sorted(found)]


PLAIN_SEARCH_BUDGET = 32_768  # text characters times literals below which ``in`` beats the RE2 set


ScanPlan = tuple[Matcher | LiteralGroup, ...]


def scan_plan(matchers: Sequence[Matcher]) -> ScanPlan:
    """``matchers`` as ``scan`` runs them best: the plain blocklist literals behind one gate, the rest as given."""
    literal = [m for m in matchers if m.literal is not None]
    literals = tuple(m.literal for m in literal if m.literal is not None)
    gate = literal_gate(literals) if len(literal) > 1 else None
    if gate is None:
        return tuple(matchers)
    return (*(m for m in matchers if m.literal is None), LiteralGroup(tuple(literal), gate, literals))


def scan(norm: Normalized, matchers: Sequence[Matcher] | ScanPlan, start: int = 0) -> list[tuple[Matcher, Hit]]:
    """The hits at or after ``start`` in normalised ``norm.text``, in order of position.

    ``matchers`` may be a ``scan_plan``. PII detectors are tried most specific
    first (``pii.DETECTORS``) and a PII hit overlapping one already taken is
    dropped (a card number is not also a phone number); blocklist hits are all
    kept (so a gated group may come last: the order it is tried in changes nothing).
    The blocklist also reads the skeleton's joined views (``normalize.joined``: ``blue-bird``
    as ``bluebird``); a hit found only there is reported on the span it covers in ``norm.text``.
    """
    text = norm.text
    kept: list[tuple[Matcher, Hit]] = []
    taken: list[Hit] = []
    for entry in matchers:
        for matcher in _group(entry, text):
            for hit in matcher.find(text):
                if hit.start < start:
                    continue
                if matcher.kind == "pii":
                    if any(hit.start < other.end and other.start < hit.end for other in taken):
                        continue
                    taken.append(hit)
                kept.append((matcher, hit))
    if matchers:
        kept += _joined_hits(norm, matchers, start, kept)
    kept.sort(key=_order)
    return kept


def _group(entry: Matcher | LiteralGroup, text: str) -> Sequence[Matcher]:
    return entry.occurring(text) if isinstance(entry, LiteralGroup) else (entry,)


def _joined_hits(
    norm: Normalized, matchers: Sequence[Matcher] | ScanPlan, start: int, found: Sequence[tuple[Matcher, Hit]]
) -> list[tuple[Matcher, Hit]]:
    """The blocklist's hits in the joined views that ``norm.text`` itself does not hold, on its spans.

    Two views: the skeleton's own, and (where spelled-out words were joined) the one of the skeleton before
    that, which keeps the article of "a b-a-d" apart (the skeleton has "abad", this view "a bad")."""
    seen = {(matcher.rule, hit.start, hit.end) for matcher, hit in found}
    out: list[tuple[Matcher, Hit]] = []
    for base in (norm, norm.unspelled):
        view = joined(base.text) if base is not None else None
        if base is None or view is None:
            continue
        for entry in matchers:
            if isinstance(entry, Matcher) and entry.kind != "blocklist":
                continue  # PII reads the skeleton only: a joiner inside a number or an address is its own
            for matcher in _group(entry, view.text):
                for hit in matcher.find(view.text):
                    begin, end = view.position(hit.start), view.position(hit.end - 1) + 1
                    if base is not norm:  # a span of the unspelled skeleton, as the skeleton's
                        first, last = base.original_span(begin, end)
                        begin, end = norm.position_of(first), norm.position_of(last)
                    if begin < start or begin >= end or (matcher.rule, begin, end) in seen:
                        continue
                    seen.add((matcher.rule, begin, end))
                    out.append((matcher, Hit(begin, end, end, hit.closed)))
    return out


def _order(pair: tuple[Matcher, Hit]) -> tuple[int, int, bool, str]:
    """Hits by position; on the same span PII first (as the detectors run first), then by rule, so the
    order is the same whether or not the literals went through a gate."""
    matcher, hit = pair
    return hit.start, -hit.end, matcher.kind != "pii", matcher.rule


def redact(
    norm: Normalized, hits: Sequence[tuple[Matcher, Hit]], start: int, end: int, origin: int | None = None
) -> str:
    """Original text of normalised ``[start, end)`` with every redact hit inside replaced by its placeholder.

    ``origin``: where in the original text to begin (default: where ``start`` came from); it
    matters when invisible characters precede ``start``.
    """
    original = norm.original
    cursor = norm.original_offset(start) if origin is None else origin
    stop = norm.original_offset(end)
    out: list[str] = []
    last_end = start
    for matcher, hit in hits:
        if matcher.action is not Action.REDACT or hit.end > end:
            continue
        span_start, span_end = norm.original_span(hit.start, hit.end)
        if hit.start < last_end:  # overlapping redactions merge into the first one's placeholder
            cursor = max(cursor, span_end)
            last_end = max(last_end, hit.end)
            continue
        out.append(original[cursor:span_start])
        out.append(matcher.placeholder)
        cursor = max(cursor, span_end)
        last_end = hit.end
    out.append(original[cursor:stop])
    return "".join(out)


def finding(matcher: Matcher, hit: Hit, norm: Normalized, index: int, offset: int = 0) -> Finding:
    start, end = norm.original_span(hit.start, hit.end)
    return Finding(
        rule=matcher.rule,
        kind=matcher.kind,
        type=matcher.type,
        action=matcher.action,
        policy=matcher.policy,
        index=index,
        start=offset + start,
        end=offset + end,
    )


@dataclass(frozen=True)
class Decision:
    """The outcome of checking a request's (or a response's) texts.

    ``texts`` are the texts to use, in the order given: redacted where a rule
    says so, unchanged otherwise. A blocked decision still lists every finding.
    """

    blocked: bool
    texts: tuple[str, ...]
    findings: tuple[Finding, ...] = field(default=())

    @property
    def allowed(self) -> bool:
        return not self.blocked

    @property
    def redacted(self) -> bool:
        return any(f.action is Action.REDACT for f in self.findings)

    @property
    def reasons(self) -> tuple[str, ...]:
        """Why it was blocked: the rules that fired, never the content."""
        return tuple(dict.fromkeys(f.reason() for f in self.findings if f.action is Action.BLOCK))

    def error(self, direction: str = "input") -> ContentFiltered:
        return ContentFiltered.from_findings(self.findings, direction=direction)

    def raise_if_blocked(self, direction: str = "input") -> None:
        if self.blocked:
            raise self.error(direction)


# Decoded spans of the input and the plan their text is checked with: (encoding, plan).
Decodings = Sequence[tuple[str, ScanPlan]]


def check_texts(
    texts: Sequence[str],
    matchers: Sequence[Matcher] | ScanPlan,
    decodings: Decodings = (),
    groups: Sequence[Sequence[int]] = (),
) -> Decision:
    """Check each of ``texts`` against ``matchers`` (or their ``scan_plan``), the conversation they make
    together and each of ``groups`` (indices of texts read as one: ``across``), and what ``decodings``
    decode; see ``Decision``."""
    # A text met again (a schema's "type", "string", "description"...) is checked once.
    seen: dict[str, tuple[Normalized, list[tuple[Matcher, Hit]]]] = {}
    for text in texts:
        if text not in seen:
            norm = normalize(text)
            seen[text] = (norm, scan(norm, matchers))
    norms = [seen[text][0] for text in texts]
    hits = [list(seen[text][1]) for text in texts]
    extra = [*across(texts, norms, matchers), *(placed for group in groups for placed in across(texts, norms,
             matchers, group)), *decoded(texts, norms, decodings)]  # fmt: skip
    for index, pair in dict.fromkeys(extra):  # a split word a group and the conversation both hold: once
        hits[index].append(pair)
    out: list[str] = []
    findings: list[Finding] = []
    for index, (text, norm, found) in enumerate(zip(texts, norms, hits, strict=True)):
        if extra:
            found.sort(key=_order)
        findings.extend(finding(matcher, hit, norm, index) for matcher, hit in found)
        has_redaction = any(matcher.action is Action.REDACT for matcher, _ in found)
        out.append(redact(norm, found, 0, len(norm.text), 0) if has_redaction else text)
    blocked = any(f.action is Action.BLOCK for f in findings)
    return Decision(blocked=blocked, texts=tuple(out), findings=tuple(findings))


# A hit in one of the texts: (which text, (matcher, hit in that text's normalised form)).
Placed = tuple[int, tuple[Matcher, Hit]]


def _place(norms: Sequence[Normalized], index: int, matcher: Matcher, start: int, end: int) -> Placed | None:
    """Original ``[start, end)`` of text ``index`` as a hit in its normalised form; None if nothing of it is left."""
    norm = norms[index]
    first, last = norm.position_of(start), norm.position_of(end)
    return (index, (matcher, Hit(first, last, last))) if first < last else None


def across(
    texts: Sequence[str],
    norms: Sequence[Normalized],
    matchers: Sequence[Matcher] | ScanPlan,
    members: Sequence[int] | None = None,
) -> list[Placed]:
    """Hits that only the whole conversation holds (or only ``members``, the indices of some of the texts,
    read as one): matches in the texts joined end to end that run from one text into the next (a word split
    across two messages), as a hit in each text they touch. Matches inside one text are its own check's;
    joined without a separator, a text's end is not a word boundary here, so those are not judged again."""
    members = range(len(texts)) if members is None else members
    if len(members) < 2 or not matchers:
        return []
    joined_norm = normalize("".join(texts[k] for k in members))
    bounds = [0]
    for k in members:
        bounds.append(bounds[-1] + len(texts[k]))
    out: list[Placed] = []
    for matcher, hit in scan(joined_norm, matchers):
        start, end = joined_norm.original_span(hit.start, hit.end)
        first, last = bisect_right(bounds, start) - 1, bisect_left(bounds, end) - 1
        for local in range(first, last + 1) if first < last else ():
            base = bounds[local]
            index = members[local]
            piece = _place(norms, index, matcher, max(start, base) - base, min(end, bounds[local + 1]) - base)
            if piece is not None:
                out.append(piece)
    return out


def decoded(texts: Sequence[str], norms: Sequence[Normalized], decodings: Decodings) -> list[Placed]:
    """Hits in the decoded spans of ``texts`` (``decode``), each as a hit on the whole encoded span."""
    out: list[Placed] = []
    for encoding, plan in decodings:
        for index, text in enumerate(texts):
            for start, end, content in DECODERS[encoding](text):
                # One hit per rule: each stands for the whole encoded span.
                for matcher in {m.rule: m for m, _ in scan(normalize(content), plan)}.values():
                    piece = _place(norms, index, matcher, start, end)
                    if piece is not None:
                        out.append(piece)
    return out
