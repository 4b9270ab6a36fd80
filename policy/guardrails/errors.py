"""The errors a guardrail decision is answered with.

A block is ``400 content_filter``, the code OpenAI and Azure OpenAI use when
their content filter refuses a prompt; an OPA deny is ``403 policy_denied``.
Both say which rule fired and never echo the content. The findings and reasons
stay on the exception for the audit event.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from inferflux.policy.errors import PermissionDenied, PolicyError, PolicyUnusable

if TYPE_CHECKING:
    from inferflux.policy.guardrails.findings import Finding


class ContentFiltered(PolicyError):
    """400: a guardrail rule in ``block`` mode matched the request."""

    status_code = 400
    error_type = "invalid_request_error"
    default_code = "content_filter"

    def __init__(self, message: str, *, reasons: Sequence[str] = (), findings: Sequence[Finding] = ()) -> None:
        super().__init__(message)
        self.reasons = tuple(reasons)
        self.findings = tuple(findings)

    @classmethod
    def from_findings(cls, findings: Iterable[Finding], *, direction: str = "input") -> ContentFiltered:
        from inferflux.policy.guardrails.findings import Action

        findings = tuple(findings)
        reasons = tuple(dict.fromkeys(f.reason() for f in findings if f.action is Action.BLOCK))
        what = "prompt" if direction == "input" else "response"
        message = f"The {what} was blocked by a content filter: {'; '.join(reasons) or 'a guardrail rule matched'}"
        return cls(message, reasons=reasons, findings=findings)


class PolicyDenied(PermissionDenied):
    """403: an OPA policy denied the request; the message carries the policy's reasons."""

    default_code = "policy_denied"

    def __init__(self, reasons: Sequence[str], *, policy: str = "") -> None:
        self.reasons = tuple(reasons)
        named = f" '{policy}'" if policy else ""
        because = "; ".join(self.reasons) or "no reason given"
        super().__init__(f"Denied by policy{named}: {because}")


class PolicyEngineUnavailable(PolicyError):
    """503: an OPA policy that fails closed could not be evaluated (error or timeout); retryable."""

    status_code = 503
    error_type = "server_error"
    default_code = "policy_engine_unavailable"


class OpaError(Exception):
    """An OPA policy could not be evaluated (compile error, bad answer, server down, no time left).

    Never answered as it is: the policy's ``on_error`` turns it into a decision
    (``OpaDecision.error``), which fails open or closed (``PolicyEngineUnavailable``).
    """


class GuardrailMisconfigured(PolicyUnusable):
    """503: a stored guardrail policy cannot be used, so its tenant's requests are refused."""


class InvalidText(PolicyError):
    """400: input the guardrails cannot read as text, so that no rule can be said to allow it: a lone
    surrogate inside a call's arguments (``invalid_unicode``), token ids that cannot be decoded for a
    tenant whose input guardrails read text (``token_ids_unchecked``). ``param`` names the field."""

    status_code = 400
    error_type = "invalid_request_error"
    default_code = "invalid_input"
