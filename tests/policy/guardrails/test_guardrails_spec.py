"""Guardrail spec validation: every refusal is a ValidationFailed naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.guardrails import Action, Direction, parse_spec

REGO = "package inferflux.guardrails\nimport rego.v1\ndefault decision := {\"allow\": true}\n"


def test_a_full_spec_parses() -> None:
    spec = parse_spec(
        {
            "direction": "input",
            "blocklist": [{"id": "a", "literal": "ＳＫＩ"}, {"regex": "x\\d+", "action": "log", "direction": "both"}],
            "pii": {"email": "redact", "card": {"mode": "block", "direction": "output"}},
            "opa": {"engine": "embedded", "rego": REGO, "timeout_ms": 50, "on_error": "allow"},
        },
        '{"opa_token": "t0k", "blocklist": [{"id": "hidden", "literal": "bluebird"}]}',
        name="acme",
    )
    assert [(r.id, r.literal, r.action, r.direction) for r in spec.blocklist] == [
        ("a", "ski", Action.BLOCK, Direction.INPUT),
        ("spec-1", None, Action.LOG, Direction.BOTH),
        ("hidden", "bluebird", Action.BLOCK, Direction.INPUT),
    ]
    assert [(p.type, p.action, p.direction) for p in spec.pii] == [
        ("email", Action.REDACT, Direction.INPUT),
        ("card", Action.BLOCK, Direction.OUTPUT),
    ]
    assert spec.opa is not None and spec.opa.fail_open and spec.opa.timeout_ms == 50
    assert "t0k" not in repr(spec)


REMOTE = {"engine": "remote", "url": "http://127.0.0.1:8181", "path": "inferflux/guardrails/decision"}


@pytest.mark.parametrize(
    ("spec", "sensitive", "param"),
    [
        ([], None, "spec"),
        ({"colour": "red"}, None, "spec"),
        ({"direction": "sideways"}, None, "spec.direction"),
        ({"blocklist": "ski"}, None, "spec.blocklist"),
        ({"blocklist": [{"id": "x"}]}, None, "spec.blocklist[0]"),
        ({"blocklist": [{"literal": "a", "regex": "b"}]}, None, "spec.blocklist[0]"),
        ({"blocklist": [{"literal": "\u200b \u200b"}]}, None, "spec.blocklist[0].literal"),
        ({"blocklist": [{"literal": "x" * 201}]}, None, "spec.blocklist[0].literal"),
        ({"blocklist": [{"literal": "a", "action": "nuke"}]}, None, "spec.blocklist[0].action"),
        ({"blocklist": [{"literal": "a", "match": "fuzzy"}]}, None, "spec.blocklist[0].match"),
        ({"blocklist": [{"id": "has space", "literal": "a"}]}, None, "spec.blocklist[0].id"),
        ({"blocklist": [{"regex": "a+", "max_length": 0}]}, None, "spec.blocklist[0].max_length"),
        ({"blocklist": [{"id": "d", "literal": "a"}, {"id": "d", "literal": "b"}]}, None, "spec.blocklist"),
        ({"pii": {"passport": "block"}}, None, "spec.pii"),
        ({"pii": {"email": "shout"}}, None, "spec.pii.email.mode"),
        ({"pii": {"email": {"direction": "input"}}}, None, "spec.pii.email.mode"),
        ({"pii": {"email": {"mode": "log", "direction": "up"}}}, None, "spec.pii.email.direction"),
        ({"opa": {"engine": "cloud"}}, None, "spec.opa.engine"),
        ({"opa": {"rego": ""}}, None, "spec.opa.rego"),
        ({"opa": {"rego": "package x\nallow if {"}}, None, "spec.opa.rego"),
        ({"opa": {"rego": REGO, "query": "inferflux.allow"}}, None, "spec.opa.query"),
        ({"opa": {"rego": REGO, "timeout_ms": 0}}, None, "spec.opa.timeout_ms"),
        ({"opa": {"rego": REGO, "on_error": "maybe"}}, None, "spec.opa.on_error"),
        ({"opa": {"rego": REGO, "url": "http://x"}}, None, "spec.opa.url"),
        ({"opa": {**REMOTE, "url": "ftp://opa"}}, None, "spec.opa.url"),
        ({"opa": {**REMOTE, "url": "http://user:pw@opa:8181"}}, None, "spec.opa.url"),
        ({"opa": {**REMOTE, "path": "../etc"}}, None, "spec.opa.path"),
        ({"opa": {**REMOTE, "rego": REGO}}, None, "spec.opa.rego"),
        ({}, "not json", "sensitive_spec"),
        ({}, '{"password": "x"}', "sensitive_spec"),
        ({}, '{"opa_token": 7}', "sensitive_spec.opa_token"),
        ({}, '{"blocklist": [{"regex": "("}]}', "sensitive_spec.blocklist[0].regex"),
    ],
)
def test_invalid_specs_name_the_field(spec: Any, sensitive: str | None, param: str) -> None:
    with pytest.raises(ValidationFailed) as caught:
        parse_spec(spec, sensitive)
    assert caught.value.param == param, caught.value.message
    assert caught.value.status_code == 422


def test_sensitive_spec_is_never_echoed() -> None:
    with pytest.raises(ValidationFailed) as caught:
        parse_spec({}, "hunter2 is not json")
    assert "hunter2" not in caught.value.message


def test_a_rego_syntax_error_says_where() -> None:
    with pytest.raises(ValidationFailed) as caught:
        parse_spec({"opa": {"rego": "package x\nallow if {"}})
    assert "does not compile" in caught.value.message
