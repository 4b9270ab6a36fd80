"""The audit event: keyed hashes instead of text, redacted text only in debug, strict validation."""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import os
import re
from datetime import datetime

import pytest

from inferflux.policy.audit.errors import InvalidAuditEvent
from inferflux.policy.audit import events as events_module
from inferflux.policy.audit.events import AuditEvent, ContentDigester, Finding, _EventIds, admin_event, api_event, new_event_id

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
