"""The audit event: one per tenant API call and one per admin action.

An event says who did what, to what, and with which outcome; it never holds a
secret, and it holds the prompt and completion only as keyed hashes
(HMAC-SHA256 under a server secret), so the trail can prove that a given text
was sent without keeping the text. With ``debug`` on, a ``ContentDigester``
also keeps the text, after the caller's redaction function.

Events are plain frozen values. ``to_json`` gives the dictionary the hash
chain covers (``policy.audit.chain``); ``from_json`` reads it back and checks
it as strictly as the constructor does, so a spooled line that was edited
into nonsense is an error, not a crash.
"""

from __future__ import annotations

import hmac
import itertools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from inferflux.policy.audit.errors import InvalidAuditEvent
from inferflux.policy.digests import HmacSha256
from inferflux.policy.ids import random_id

KINDS: Final = ("api", "admin", "checkpoint")  # checkpoint: a signed chain head (policy.audit.checkpoint)
DECISIONS: Final = ("allow", "deny", "error")
STAGES: Final = ("input", "output")
# The status of a call whose client left before its answer was complete (nginx's convention): the
# client's own doing, neither a refusal nor the server's failure (usage counts it apart).
CLIENT_CLOSED_STATUS: Final = 499
_MAX_TEXT = 255
_MAX_REASONS = 32
_MAX_FINDINGS = 64


class _EventIds:
    """``aev_`` and 20 base32 characters: 12 drawn at random per process (60 bits), then a counter (40 bits).

    Unique across replicas and restarts, for de-duplication, without a system
    call per event (one is made for every answered request). A forked child,
    or a counter that ran out, draws a new prefix.
    """

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self._prefix, self._counter = random_id("aev", 12), itertools.count()

    def next(self) -> str:
        n = next(self._counter)
        if n >> 40:
            self.reseed()
            n = next(self._counter)
        # base32 of the 40-bit counter, 10 bits (two characters) at a time: a fifth of b32encode's cost.
        pairs = _BASE32_PAIRS
        return self._prefix + pairs[n >> 30] + pairs[(n >> 20) & 1023] + pairs[(n >> 10) & 1023] + pairs[n & 1023]


_BASE32 = "abcdefghijklmnopqrstuvwxyz234567"  # RFC 4648's alphabet, lower case
_BASE32_PAIRS = tuple(a + b for a in _BASE32 for b in _BASE32)


_event_ids = _EventIds()


def new_event_id() -> str:
    """A new event id (``_EventIds``): ``aev_`` and 20 lower-case base32 characters."""
    return _event_ids.next()


@dataclass(frozen=True, slots=True)
class Finding:
    """What a guardrail found: its type and rule, never the matched text."""

    type: str  # "pii.email", "blocklist", "opa", ...
    rule_id: str | None = None
    stage: str = "input"  # "input" | "output"
    action: str = "log"  # "block" | "redact" | "log"

    def __post_init__(self) -> None:
        _text(self.type, "finding.type")
        _optional_text(self.rule_id, "finding.rule_id")
        _choice(self.stage, "finding.stage", STAGES)
        _text(self.action, "finding.action")

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "rule_id": self.rule_id, "stage": self.stage, "action": self.action}


_OPTIONAL_TEXTS = ("request_id", "principal", "route", "model", "user", "action", "target_kind", "target_id",
                   "prompt_hmac", "completion_hmac")


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """One audited call. Build API-call events with ``api_event`` and admin actions with ``admin_event``."""

    kind: str  # "api" | "admin"
    decision: str  # "allow" | "deny" | "error"
    id: str = field(default_factory=new_event_id)
    at: datetime = field(default_factory=lambda: datetime.now(UTC))
    request_id: str | None = None
    tenant_id: str | None = None  # None: platform-level (an admin action on no tenant)
    principal: str | None = None  # "key:<id>", "oidc:<issuer>#<sub>", ...
    key_id: str | None = None
    route: str | None = None  # "POST /v1/chat/completions"
    model: str | None = None
    user: str | None = None  # the end user the caller named (OpenAI's ``user``): an id of its own, not ours
    reasons: tuple[str, ...] = ()  # machine codes: "rate_limited", "guardrail.blocklist", ...
    findings: tuple[Finding, ...] = ()
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    status: int | None = None  # the HTTP status answered
    latency_ms: float | None = None
    prompt_hmac: str | None = None
    completion_hmac: str | None = None
    prompt_text: str | None = None  # debug only, already redacted
    completion_text: str | None = None
    action: str | None = None  # admin: "tenant.create", "key.revoke", ...
    target_kind: str | None = None
    target_id: str | None = None
    detail: Mapping[str, Any] | None = None  # admin: a summary, never a secret

    def __post_init__(self) -> None:
        _choice(self.kind, "kind", KINDS)
        _choice(self.decision, "decision", DECISIONS)
        for name in ("id", "tenant_id", "key_id"):  # ids: indexed columns of 64 characters
            value = getattr(self, name)
            if (value is not None or name == "id") and (not isinstance(value, str) or not 1 <= len(value) <= 64):
                raise InvalidAuditEvent(f"{name} must be a string of 1 to 64 characters", param=name)
        if not isinstance(self.at, datetime) or self.at.tzinfo is None:
            raise InvalidAuditEvent("at must be an aware datetime", param="at")
        for name in _OPTIONAL_TEXTS:  # inline, not _optional_text: every answered call builds an event
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not 1 <= len(value) <= _MAX_TEXT):
                _text(value, name)  # raises, saying what is wrong
        if not isinstance(self.reasons, tuple) or len(self.reasons) > _MAX_REASONS:
            raise InvalidAuditEvent(f"reasons must be a tuple of at most {_MAX_REASONS} codes", param="reasons")
        for reason in self.reasons:
            _text(reason, "reasons")
        if not isinstance(self.findings, tuple) or len(self.findings) > _MAX_FINDINGS:
            raise InvalidAuditEvent(f"findings must be a tuple of at most {_MAX_FINDINGS}", param="findings")
        if not all(isinstance(f, Finding) for f in self.findings):
            raise InvalidAuditEvent("findings must be Finding values", param="findings")
        for name in ("prompt_tokens", "completion_tokens", "status"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise InvalidAuditEvent(f"{name} must be a non-negative integer", param=name)
        if self.latency_ms is not None and (
            isinstance(self.latency_ms, bool)
            or not isinstance(self.latency_ms, int | float)
            or not 0 <= self.latency_ms < float("inf")  # NaN fails this too
        ):
            raise InvalidAuditEvent("latency_ms must be a non-negative number", param="latency_ms")
        for name in ("prompt_text", "completion_text"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidAuditEvent(f"{name} must be a string", param=name)
        if self.detail is not None:
            try:
                if not isinstance(self.detail, Mapping):
                    raise TypeError(type(self.detail).__name__)
                json.dumps(dict(self.detail), allow_nan=False)
            except (TypeError, ValueError):
                raise InvalidAuditEvent("detail must be a JSON object", param="detail") from None

    def to_json(self) -> dict[str, Any]:
        """The event as JSON values: what the chain hashes and the sinks send."""
        return {
            "id": self.id,
            "at": self.at.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "kind": self.kind,
            "decision": self.decision,
            "request_id": self.request_id,
            "tenant_id": self.tenant_id,
            "principal": self.principal,
            "key_id": self.key_id,
            "route": self.route,
            "model": self.model,
            "user": self.user,
            "reasons": list(self.reasons),
            "findings": [f.to_json() for f in self.findings],
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "status": self.status,
            # Rounded so the JSON text is short and every reader parses the same number back.
            "latency_ms": None if self.latency_ms is None else round(float(self.latency_ms), 3),
            "prompt_hmac": self.prompt_hmac,
            "completion_hmac": self.completion_hmac,
            "prompt_text": self.prompt_text,
            "completion_text": self.completion_text,
            "action": self.action,
            "target_kind": self.target_kind,
            "target_id": self.target_id,
            "detail": None if self.detail is None else dict(self.detail),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AuditEvent:
        """Read ``to_json``'s output back; InvalidAuditEvent if it is not one."""
        if not isinstance(data, Mapping):
            raise InvalidAuditEvent("an audit event must be a JSON object")
        try:
            at = datetime.fromisoformat(str(data["at"]).replace("Z", "+00:00"))
            findings = tuple(Finding(**f) for f in data.get("findings") or ())
            values = {k: data.get(k) for k in _SCALARS}
            return cls(
                **values,
                id=data["id"],
                at=at,
                reasons=tuple(data.get("reasons") or ()),
                findings=findings,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidAuditEvent(f"not an audit event: {exc}") from None


_SCALARS = (
    "kind", "decision", "request_id", "tenant_id", "principal", "key_id", "route", "model", "user", "prompt_tokens",
    "completion_tokens", "status", "latency_ms", "prompt_hmac", "completion_hmac", "prompt_text",
    "completion_text", "action", "target_kind", "target_id", "detail",
)  # fmt: skip


class ContentDigester:
    """Turns prompts and completions into what an event may hold.

    Always a keyed hash: HMAC-SHA256 under ``secret`` (the server's, at least
    16 bytes), so nobody without the secret can test a guess against the
    trail. With ``debug`` the text is kept too, but only after ``redact``
    (required then: raw text must never reach a SIEM by default).
    """

    __slots__ = ("_hmac", "_debug", "_redact")

    def __init__(self, secret: bytes, *, debug: bool = False, redact: Callable[[str], str] | None = None) -> None:
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("the audit content secret must be at least 16 bytes")
        if debug and redact is None:
            raise ValueError("debug content capture needs a redaction function")
        self._hmac = HmacSha256(secret)  # keyed once: a digest per prompt and per completion (policy.digests)
        self._debug = debug
        self._redact = redact

    def __repr__(self) -> str:
        return f"ContentDigester(debug={self._debug})"

    def digest(self, text: str | None) -> str | None:
        if text is None:
            return None
        return self._hmac.hexdigest(text.encode("utf-8", "surrogatepass"))

    def matches(self, text: str, digest: str) -> bool:
        """Whether ``text`` is what ``digest`` was made from (constant time)."""
        return hmac.compare_digest(self.digest(text) or "", digest)

    def kept_text(self, text: str | None) -> str | None:
        if text is None or not self._debug or self._redact is None:
            return None
        return self._redact(text)


def api_event(
    *,
    decision: str,
    digester: ContentDigester | None = None,
    prompt: str | None = None,
    completion: str | None = None,
    findings: Sequence[Finding] = (),
    reasons: Sequence[str] = (),
    kind: str = "api",
    **fields: Any,
) -> AuditEvent:
    """An event for one API call; ``prompt``/``completion`` become hashes (and redacted text in debug).

    ``fields`` are ``AuditEvent``'s other fields (request_id, tenant_id, ...);
    ``kind`` is "admin" for a refused call of the admin API.
    """
    if (prompt is not None or completion is not None) and digester is None:
        raise InvalidAuditEvent("prompt and completion need a ContentDigester: raw text is never audited as is")
    content: dict[str, Any] = {}
    if digester is not None:
        content = {
            "prompt_hmac": digester.digest(prompt),
            "completion_hmac": digester.digest(completion),
            "prompt_text": digester.kept_text(prompt),
            "completion_text": digester.kept_text(completion),
        }
    return AuditEvent(
        kind=kind, decision=decision, findings=tuple(findings), reasons=tuple(reasons), **content, **fields
    )


def admin_event(
    *,
    principal: str,
    action: str,
    target_kind: str,
    target_id: str | None = None,
    tenant_id: str | None = None,
    detail: Mapping[str, Any] | None = None,
    decision: str = "allow",
    **fields: Any,
) -> AuditEvent:
    """An event for one admin action: the same fields ``PolicyStore.record_admin_event`` takes."""
    return AuditEvent(
        kind="admin",
        decision=decision,
        principal=principal[:_MAX_TEXT],  # an audit record is better cut short than lost
        action=action,
        target_kind=target_kind,
        target_id=target_id,
        tenant_id=tenant_id,
        detail=detail,
        **fields,
    )


def checkpoint_event(checkpoint: Mapping[str, Any]) -> AuditEvent:
    """The chain's own record of a signed checkpoint (``Checkpoint.to_json()``), for the sinks."""
    return AuditEvent(kind="checkpoint", decision="allow", action="checkpoint", detail=checkpoint)


def _text(value: object, param: str) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= _MAX_TEXT:
        raise InvalidAuditEvent(f"{param} must be a string of 1 to {_MAX_TEXT} characters", param=param)
    return value


def _optional_text(value: object, param: str) -> None:
    if value is not None:
        _text(value, param)


def _choice(value: object, param: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InvalidAuditEvent(f"{param} must be one of {', '.join(choices)}", param=param)
