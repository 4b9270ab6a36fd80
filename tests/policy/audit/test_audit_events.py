"""The audit event: keyed hashes instead of text, redacted text only in debug, strict validation."""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import os
import re
import types
from datetime import UTC, datetime, timedelta, timezone
from http import HTTPStatus

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.audit.errors import InvalidAuditEvent
from policy.audit import events as events_module
from policy.audit.events import (
    DECISIONS,
    KINDS,
    AuditEvent,
    ContentDigester,
    Finding,
    _EventIds,
    admin_event,
    api_event,
    new_event_id,
)

SECRET = b"0123456789abcdef0123456789abcdef"


def test_prompt_and_completion_are_keyed_hashes_not_text() -> None:
    digester = ContentDigester(SECRET)
    event = api_event(decision="allow", digester=digester, prompt="my card is 4111", completion="ok", tenant_id="t")
    data = json.dumps(event.to_json())
    assert "4111" not in data and "my card" not in data
    assert event.prompt_hmac == hmac.new(SECRET, b"my card is 4111", hashlib.sha256).hexdigest()
    assert event.prompt_hmac != hashlib.sha256(b"my card is 4111").hexdigest()  # keyed, not a plain hash
    assert digester.matches("my card is 4111", event.prompt_hmac)
    assert not digester.matches("my card is 4112", event.prompt_hmac)
    assert event.prompt_text is None and event.completion_text is None


def test_debug_keeps_text_only_after_redaction() -> None:
    digester = ContentDigester(SECRET, debug=True, redact=lambda text: text.replace("4111", "[CARD]"))
    event = api_event(decision="allow", digester=digester, prompt="my card is 4111", completion="noted 4111")
    assert event.prompt_text == "my card is [CARD]" and event.completion_text == "noted [CARD]"
    with pytest.raises(ValueError, match="redaction"):
        ContentDigester(SECRET, debug=True)
    with pytest.raises(ValueError, match="16 bytes"):
        ContentDigester(b"short")
    assert "0123" not in repr(digester)


def test_raw_text_without_a_digester_is_refused() -> None:
    with pytest.raises(InvalidAuditEvent, match="ContentDigester"):
        api_event(decision="allow", prompt="secret text")


def test_json_round_trip_keeps_every_field() -> None:
    event = api_event(
        decision="deny",
        digester=ContentDigester(SECRET),
        prompt="p",
        request_id="req-1",
        tenant_id="ten_a",
        principal="key:k",
        key_id="key_k",
        route="POST /v1/completions",
        model="m",
        reasons=("guardrail.blocklist",),
        findings=[Finding("blocklist", "rule-7", "output", "block")],
        prompt_tokens=3,
        completion_tokens=0,
        status=400,
        latency_ms=1.23456,
    )
    data = json.loads(json.dumps(event.to_json()))
    again = AuditEvent.from_json(data)
    assert again.to_json() == event.to_json()
    assert data["latency_ms"] == 1.235 and data["at"].endswith("Z")
    assert data["findings"] == [{"type": "blocklist", "rule_id": "rule-7", "stage": "output", "action": "block"}]


def test_admin_actions_fit_the_same_event() -> None:
    event = admin_event(principal="key:admin", action="key.revoke", target_kind="api_key", target_id="key_1",
                        tenant_id="ten_a", detail={"name": "ci"})  # fmt: skip
    data = event.to_json()
    assert data["kind"] == "admin" and data["action"] == "key.revoke" and data["detail"] == {"name": "ci"}
    assert AuditEvent.from_json(data) == event
    long = admin_event(principal="x" * 1000, action="a", target_kind="t")
    assert long.principal == "x" * 255  # cut short rather than lost


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"kind": "other"}, "kind"),
        ({"decision": "maybe"}, "decision"),
        ({"status": -1}, "status"),
        ({"status": True}, "status"),
        ({"prompt_tokens": "3"}, "prompt_tokens"),
        ({"latency_ms": -0.5}, "latency_ms"),
        ({"latency_ms": float("nan")}, "latency_ms"),
        ({"detail": {"when": datetime(2026, 1, 1)}}, "detail"),
        ({"tenant_id": "t" * 65}, "tenant_id"),
        ({"route": ""}, "route"),
        ({"reasons": ["not a tuple"]}, "reasons"),
        ({"at": datetime(2026, 1, 1)}, "at"),
        ({"detail": ["no"]}, "detail"),
    ],
)
def test_invalid_events_are_clear_errors(fields: dict[str, object], param: str) -> None:
    values: dict[str, object] = {"kind": "api", "decision": "allow", **fields}
    with pytest.raises(InvalidAuditEvent) as caught:
        AuditEvent(**values)  # type: ignore[arg-type]
    assert caught.value.param == param and caught.value.status_code == 500


@pytest.mark.parametrize("data", [{}, {"id": "x"}, {"id": "x", "at": "yesterday", "kind": "api", "decision": "allow"},
                                  [1, 2], {"id": "x", "at": "2026-01-01T00:00:00Z", "kind": "api",
                                           "decision": "allow", "findings": [{"bogus": 1}]}])  # fmt: skip
def test_from_json_rejects_what_is_not_an_event(data: object) -> None:
    with pytest.raises(InvalidAuditEvent):
        AuditEvent.from_json(data)  # type: ignore[arg-type]


def test_event_ids_are_unique_well_formed_and_differ_in_a_forked_child() -> None:
    ids = [new_event_id() for _ in range(1000)]
    assert len(set(ids)) == 1000 and all(re.fullmatch(r"aev_[a-z2-7]{20}", i) for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its ids must not repeat the parent's (same counter, new prefix)
        os.write(write, new_event_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 100).decode()
    os.waitpid(pid, 0)
    os.close(read)
    parent = new_event_id()
    assert re.fullmatch(r"aev_[a-z2-7]{20}", child) and child[:16] != parent[:16]


def test_event_ids_take_a_new_prefix_when_the_counter_runs_out(monkeypatch: pytest.MonkeyPatch) -> None:
    before = new_event_id()
    monkeypatch.setattr(events_module._event_ids, "_counter", iter([1 << 40]))
    after = new_event_id()
    assert after[:16] != before[:16] and after.endswith("a" * 8)  # the new prefix's first id


@pytest.mark.parametrize("counter", [0, 1, 31, 32, 1023, 1024, 0x123456789A, (1 << 40) - 1])
def test_an_event_id_ends_in_its_counter_in_base32(counter: int) -> None:
    # The last eight characters are the 40-bit counter, RFC 4648 base32 in lower case.
    ids = _EventIds()
    ids._counter = itertools.count(counter)
    expected = base64.b32encode(counter.to_bytes(5, "big")).decode("ascii").lower()
    assert ids.next() == ids._prefix + expected


@pytest.mark.parametrize("size", [16, 32, 63, 64, 65, 200])
@pytest.mark.parametrize("text", ["", "hello", "zürich \ud800 a lone surrogate", "x" * 5000])
def test_a_digest_is_the_standard_hmac_sha256_whatever_the_key_length(size: int, text: str) -> None:
    # The digester keys SHA-256 itself (RFC 2104); it must give what hmac.new gives, long keys hashed first.
    secret = bytes(range(size))
    expected = hmac.new(secret, text.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
    digester = ContentDigester(secret)
    assert digester.digest(text) == expected and digester.digest(text) == expected  # the keyed states are reused
    assert digester.matches(text, expected) and not digester.matches(text + "!", expected)


# -- the quick check is never more lenient than the full one ----------------------------------------


class _Str(str):
    pass


_TEXTS = st.sampled_from([None, "", "a", "x" * 64, "x" * 65, "x" * 255, "x" * 256, _Str("s"), 0, False, b"b", ["l"]])
_COUNTS = st.sampled_from([None, 0, 1, -1, 2**70, True, False, 1.0, "3", HTTPStatus.OK])
_FIELDS = {
    "kind": st.sampled_from([*KINDS, "other", None, ["api"]]),
    "decision": st.sampled_from([*DECISIONS, "maybe", None]),
    "id": _TEXTS, "tenant_id": _TEXTS, "key_id": _TEXTS,
    "at": st.sampled_from([datetime.now(UTC), datetime(2026, 1, 1), "2026-01-01", None,
                           datetime.now(timezone(timedelta(hours=2)))]),
    **{name: _TEXTS for name in ("request_id", "principal", "route", "model", "user", "action", "target_kind",
                                 "target_id", "prompt_hmac", "completion_hmac", "prompt_text", "completion_text")},
    "reasons": st.sampled_from([(), ("r",), ("",), ("x" * 256,), ("r",) * 33, ["r"], (1,), (_Str("r"),)]),
    "findings": st.sampled_from([(), (Finding("pii.email"),), ("f",), [Finding("x")], (Finding("x"),) * 65]),
    "prompt_tokens": _COUNTS, "completion_tokens": _COUNTS, "status": _COUNTS,
    "latency_ms": st.sampled_from([None, 0, 0.5, -0.5, float("nan"), float("inf"), True, "1", 10**400]),
    "detail": st.sampled_from([None, {}, {"a": 1}, {"a": datetime(2026, 1, 1)}, ["x"]]),
}  # fmt: skip


_VALID = {"kind": "api", "decision": "allow", "id": "aev_1", "tenant_id": None, "key_id": None, "at": datetime.now(UTC),
          **dict.fromkeys(("request_id", "principal", "route", "model", "user", "action", "target_kind", "target_id",
                           "prompt_hmac", "completion_hmac", "prompt_text", "completion_text")),
          "reasons": (), "findings": (), "prompt_tokens": None, "completion_tokens": None, "status": None,
          "latency_ms": None, "detail": None}  # fmt: skip


@st.composite
def _candidates(draw: st.DrawFn) -> dict[str, object]:
    """A valid event's fields with one to three of them replaced from their pools of good and bad values:
    a rule the quick check missed shows when its field alone is wrong."""
    names = draw(st.lists(st.sampled_from(sorted(_FIELDS)), min_size=1, max_size=3, unique=True))
    return {**_VALID, **{name: draw(_FIELDS[name]) for name in names}}


def test_the_valid_baseline_passes_both_checks() -> None:
    assert AuditEvent._plainly_valid(types.SimpleNamespace(**_VALID))  # type: ignore[arg-type]
    AuditEvent._validate(types.SimpleNamespace(**_VALID))  # type: ignore[arg-type]


@given(_candidates())
@settings(max_examples=3000, deadline=None)
def test_what_the_quick_check_passes_the_full_check_passes(fields: dict[str, object]) -> None:
    candidate = types.SimpleNamespace(**fields)
    try:
        quick = AuditEvent._plainly_valid(candidate)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        quick = False  # as for a False: the full check judges it
    if quick:
        AuditEvent._validate(candidate)  # type: ignore[arg-type]  # must not raise


def test_a_served_calls_event_takes_the_quick_check() -> None:
    event = api_event(decision="allow", digester=ContentDigester(SECRET), prompt="p", completion="c",
                      request_id="req_1", tenant_id="ten_a", principal="key:k", key_id="key_k",
                      route="POST /v1/completions", model="m", prompt_tokens=3, completion_tokens=1, status=200,
                      latency_ms=1.5, findings=[Finding("pii.email", "pii.email", "input", "redact")])  # fmt: skip
    assert event._plainly_valid()
