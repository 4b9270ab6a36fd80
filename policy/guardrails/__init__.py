"""Guardrails: blocklists, PII detection and redaction, streamed output checks, and OPA policies.

Typical use on the request path::

    guardrails = await resolver.resolve(principal.tenant_id)         # GuardrailResolver(store)
    screened = await screen(guardrails, body, size, decode)          # every text, off the loop when large
    screened.decision.raise_if_blocked()                             # 400 content_filter (None: no input rules)
    body = screened.body                                             # redacted, if any rule redacts
    verdict = await guardrails.authorize(opa_input(principal, model=..., route=..., prompt_tokens=...,
                                                   findings=screened.decision.findings))
    verdict.raise_for_deny()                                         # 403 policy_denied / 503
    stream = guardrails.output_stream()
    for delta in generated:                                          # per choice
        step = stream.feed(delta)                                    # send step.text; stop if step.blocked
    step = stream.flush()

See ``spec`` for the policy format, ``texts`` for what of a body is read,
``screen`` for the input check of a body, ``normalize`` for what obfuscation
is undone, ``pii`` for the detectors and ``stream`` for the hold-back bound.
"""

from __future__ import annotations

from inferflux.policy.guardrails.check import Decision
from inferflux.policy.guardrails.engine import EMPTY, Guardrails, validate_policy
from inferflux.policy.guardrails.errors import ContentFiltered, GuardrailMisconfigured, InvalidText, PolicyDenied
from inferflux.policy.guardrails.errors import PolicyEngineUnavailable
from inferflux.policy.guardrails.findings import Action, Direction, Finding
from inferflux.policy.guardrails.normalize import Normalized, normalize
from inferflux.policy.guardrails.opa import EmbeddedRego, OpaDecision, RemoteOpa, opa_input
from inferflux.policy.guardrails.pii import PII_TYPES
from inferflux.policy.guardrails.resolver import GuardrailResolver
from inferflux.policy.guardrails.spec import KIND, GuardrailSpec, parse_spec
from inferflux.policy.guardrails.stream import OutputStream, StreamStep
from inferflux.policy.guardrails.texts import request_texts, with_texts

__all__ = [
    "EMPTY",
    "KIND",
    "PII_TYPES",
    "Action",
    "ContentFiltered",
    "Decision",
    "Direction",
    "EmbeddedRego",
    "Finding",
    "GuardrailMisconfigured",
    "GuardrailResolver",
    "GuardrailSpec",
    "Guardrails",
    "InvalidText",
    "Normalized",
    "OpaDecision",
    "OutputStream",
    "PolicyDenied",
    "PolicyEngineUnavailable",
    "RemoteOpa",
    "StreamStep",
    "normalize",
    "opa_input",
    "parse_spec",
    "request_texts",
    "validate_policy",
    "with_texts",
]
