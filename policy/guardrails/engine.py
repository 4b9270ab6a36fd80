"""A tenant's effective guardrails, compiled: input check, output check (whole or streamed), OPA.

Several policies apply to one tenant (the global ones and its own). Their
blocklist rules all apply; for a PII type named by several, the strictest mode
wins (block > redact > log); every OPA policy must allow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.guardrails.blocklist import compile_regex, is_plain, literal_finder, regex_finder
from inferflux.policy.guardrails import confusables
from inferflux.policy.guardrails.check import Decision, Decodings, check_texts, scan_plan
from inferflux.policy.guardrails.findings import Action, Direction, Matcher
from inferflux.policy.guardrails.normalize import JOINED_SPAN
from inferflux.policy.guardrails.opa import OpaDecision, PolicyEngine, build_engine, decide_all, decide_inline
from inferflux.policy.guardrails.pii import DETECTORS, PLACEHOLDERS
from inferflux.policy.guardrails.spec import DECODINGS, GuardrailSpec, parse_spec
from inferflux.policy.guardrails.stream import OutputStream, holdback

BLOCKLIST_PLACEHOLDER = "[REDACTED]"


def _blocklist_matchers(spec: GuardrailSpec, direction: Direction) -> list[Matcher]:
    out = []
    for rule in spec.blocklist:
        if not rule.direction.covers(direction):
            continue
        plain = None
        longest = rule.max_length
        if rule.literal is not None:
            find = literal_finder(rule.literal, word=rule.word)
            spaces = " " in rule.literal
            plain = rule.literal if is_plain(rule.literal) else None
            longest *= JOINED_SPAN  # found in the joined view, joiners may stand between its characters
        else:
            find = regex_finder(compile_regex(rule.regex or "", "regex"), word=rule.word)
            spaces = True  # a pattern may match a space; assume it does
        placeholder = BLOCKLIST_PLACEHOLDER
        out.append(
            Matcher(
                f"blocklist.{rule.id}", "blocklist", "blocklist", rule.action, placeholder, find, longest,
                spaces, spec.name, plain,
            )
        )
    return out


def _pii_matchers(specs: Sequence[GuardrailSpec], direction: Direction) -> list[Matcher]:
    strictest: dict[str, tuple[Action, str]] = {}
    for spec in specs:
        for rule in spec.pii:
            if rule.direction.covers(direction):
                held = strictest.get(rule.type)
                if held is None or rule.action.rank > held[0].rank:
                    strictest[rule.type] = (rule.action, spec.name)
    out = []
    for detector in DETECTORS:  # most specific first: the order overlaps resolve in
        if detector.type in strictest:
            action, policy = strictest[detector.type]
            placeholder = PLACEHOLDERS[detector.type]
            rule = f"pii.{detector.type}"
            out.append(
                Matcher(
                    rule, "pii", detector.type, action, placeholder, detector.search, detector.max_length,
                    detector.spaces, policy,
                )
            )
    return out


def _decodings(specs: Sequence[GuardrailSpec]) -> Decodings:
    """For each encoding some policy decodes: the input blocklist rules of the policies that decode it."""
    out = []
    for encoding in DECODINGS:
        matchers = [m for spec in specs if encoding in spec.decode for m in _blocklist_matchers(spec, Direction.INPUT)]
        if matchers:
            out.append((encoding, scan_plan(matchers)))
    return tuple(out)


class Guardrails:
    """The compiled guardrails of one tenant at one policy version; immutable and shared across requests."""

    def __init__(self, specs: Sequence[GuardrailSpec], engines: Sequence[PolicyEngine] | None = None) -> None:
        """``engines``: already-built OPA engines (the resolver reuses them); built from ``specs`` if None."""
        self.specs = tuple(specs)
        self.input_matchers = tuple(_pii_matchers(specs, Direction.INPUT)) + tuple(
            m for spec in specs for m in _blocklist_matchers(spec, Direction.INPUT)
        )
        self.output_matchers = tuple(_pii_matchers(specs, Direction.OUTPUT)) + tuple(
            m for spec in specs for m in _blocklist_matchers(spec, Direction.OUTPUT)
        )
        self._output_holdback = holdback(self.output_matchers)  # the same for every stream
        self._input_plan, self._output_plan = scan_plan(self.input_matchers), scan_plan(self.output_matchers)
        self._decodings = _decodings(specs)
        if self.input_matchers or self.output_matchers:
            confusables.load()  # the look-alike table, built now rather than on some request's first accent
        if engines is None:
            engines = [build_engine(spec.name, spec.opa) for spec in specs if spec.opa is not None]
        self.engines = tuple(engines)
        self.inline_engines = tuple(engine for engine in self.engines if engine.inline)
        self.deferred_engines = tuple(engine for engine in self.engines if not engine.inline)

    @property
    def checks_input(self) -> bool:
        return bool(self.input_matchers)

    @property
    def checks_output(self) -> bool:
        return bool(self.output_matchers)

    def check_input(self, texts: Sequence[str], groups: Sequence[Sequence[int]] = ()) -> Decision:
        """Check a request's texts (``request_texts``): allow, possibly redacted, or block with reasons.

        Each text is checked, and the conversation they make together, and each of ``groups`` (the indices
        of texts the model reads as one: ``RequestTexts.groups``), and (for policies that ask) their
        decoded base64 and hex spans."""
        return check_texts(texts, self._input_plan, self._decodings, groups)

    def check_output(self, text: str) -> Decision:
        """Check a whole (non-streamed) response text."""
        return check_texts([text], self._output_plan)

    def output_stream(self) -> OutputStream:
        """An incremental checker for one streamed response (one per choice)."""
        return OutputStream(self.output_matchers, self._output_holdback, plan=self._output_plan)

    async def authorize(self, document: Mapping[str, Any]) -> OpaDecision:
        """Ask every OPA policy about ``document`` (``opa_input``); call ``raise_for_deny`` on the answer."""
        now = self.authorize_inline(document)
        if not now.allowed or not self.deferred_engines:
            return now
        later = await self.authorize_deferred(document)
        if not later.allowed or not self.inline_engines:
            return later
        names, errors = filter(None, (now.policy, later.policy)), filter(None, (now.error, later.error))
        return OpaDecision(True, (), ",".join(names), "; ".join(errors) or None)

    def authorize_inline(self, document: Mapping[str, Any]) -> OpaDecision:
        """The inline policies' decision (the global ones), evaluated now on this thread; allowed if none."""
        return decide_inline(self.inline_engines, document)

    async def authorize_deferred(self, document: Mapping[str, Any]) -> OpaDecision:
        """The other policies' decision (thread pool, remote server), awaited; allowed if none."""
        return await decide_all(self.deferred_engines, document)

    async def aclose(self) -> None:
        """Close OPA clients; only for guardrails built directly (the resolver closes its own: ``aclose``)."""
        for engine in self.engines:
            await engine.aclose()


EMPTY = Guardrails(())


def validate_policy(spec: Mapping[str, Any], sensitive_spec: str | None = None, *, name: str = "") -> GuardrailSpec:
    """``parse_spec``, then compile the result as the resolver will, so that what a writer stores can be read.

    ``parse_spec`` checks each field (and compiles Rego and each regex); this also
    builds the matchers and the scan plans (the literal gate). Anything that fails
    there is refused now rather than failing every request of the tenant later.
    """
    parsed = parse_spec(spec, sensitive_spec, name=name)
    try:
        Guardrails([parsed], engines=())  # OPA engines: the Rego was compiled by parse_spec
    except Exception as exc:  # a bug or a limit of RE2: a 422 beats storing it
        # Never the exception's text: it may quote a confidential rule.
        raise ValidationFailed(f"spec cannot be compiled ({type(exc).__name__})", param="spec") from None
    return parsed
