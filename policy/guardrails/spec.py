"""The guardrail policy: what a ``policies`` row of kind ``guardrail`` holds, and its validation.

``spec`` (plain JSON in the store)::

    {
      "direction": "both",                      # input | output | both (default for the rules below)
      "blocklist": [
        {"id": "no-ski", "literal": "ski"},     # action block, match "word"
        {"id": "codes", "regex": "project\\\\s*x\\\\d+", "action": "redact", "direction": "output"},
        {"literal": "acme", "match": "substring", "action": "log"}
      ],
      "pii": {"email": "redact", "card": "block", "secret": {"mode": "block", "direction": "both"}},
      "decode": ["base64", "hex"],              # also check the blocklist on decoded spans of the input
      "opa": {"engine": "embedded", "rego": "package inferflux.guardrails ...",
              "query": "data.inferflux.guardrails.decision", "timeout_ms": 100, "on_error": "deny"}
    }

``opa`` may instead name a server: ``{"engine": "remote", "url": "http://opa:8181",
"path": "inferflux/guardrails/decision", "timeout_ms": 100, "on_error": "allow"}``.

``sensitive_spec`` (encrypted at rest) is a JSON object too, for what must not
be readable in the database: more blocklist rules (a confidential project
name) and the remote OPA server's bearer token::

    {"blocklist": [{"id": "secret-project", "literal": "bluebird"}], "opa_token": "..."}

Every failure is a ``ValidationFailed`` whose ``param`` names the field, such
as ``spec.blocklist[2].regex``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.guardrails.blocklist import (
    DEFAULT_REGEX_MAX_LENGTH,
    compile_regex,
    normalize_literal,
    regex_max_length,
)
from inferflux.policy.guardrails.decode import DECODERS
from inferflux.policy.guardrails.findings import Action, Direction
from inferflux.policy.guardrails.pii import PII_TYPES
from inferflux.policy.guardrails.rego import check_rego

KIND = "guardrail"
DECODINGS = tuple(DECODERS)
MAX_RULES = 500
MAX_REGO_LENGTH = 64 * 1024
DEFAULT_OPA_QUERY = "data.inferflux.guardrails.decision"
_RULE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
_QUERY = re.compile(r"^data(\.[A-Za-z_][A-Za-z0-9_]*)+$")
_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(/[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True, slots=True)
class BlocklistRule:
    id: str
    action: Action
    direction: Direction
    literal: str | None = None  # normalised
    regex: str | None = None
    word: bool = True
    max_length: int = 0  # the longest match a stream must hold back for


@dataclass(frozen=True, slots=True)
class PiiRule:
    type: str
    action: Action
    direction: Direction


class OpaEngine(StrEnum):
    """Where a policy's Rego is evaluated: in this process (rego-cpp) or by an OPA server."""

    EMBEDDED = "embedded"
    REMOTE = "remote"


@dataclass(frozen=True, slots=True)
class OpaSettings:
    engine: OpaEngine  # a string naming one is taken too (ValueError for any other)
    timeout_ms: int
    fail_open: bool  # on_error "allow"
    rego: str | None = None
    query: str = DEFAULT_OPA_QUERY
    url: str | None = None
    path: str | None = None
    token: str | None = None  # from sensitive_spec; never logged

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", OpaEngine(self.engine))  # frozen: set once, here

    def __repr__(self) -> str:
        where = self.url if self.engine is OpaEngine.REMOTE else self.query
        return f"OpaSettings({self.engine}, {where!r}, timeout_ms={self.timeout_ms}, fail_open={self.fail_open})"


@dataclass(frozen=True, slots=True)
class GuardrailSpec:
    """One validated guardrail policy."""

    name: str
    blocklist: tuple[BlocklistRule, ...]
    pii: tuple[PiiRule, ...]
    opa: OpaSettings | None
    decode: tuple[str, ...] = ()  # encodings (DECODINGS) whose spans of a request are decoded for the blocklist


def parse_spec(
    spec: Mapping[str, Any], sensitive_spec: str | None = None, *, name: str = ""
) -> GuardrailSpec:
    """Validate a guardrail policy's ``spec`` (and ``sensitive_spec``); ValidationFailed names the field.

    Writers call ``engine.validate_policy``, which also compiles the result as the resolver will.
    """
    _encodable(name, "name")
    _object(spec, "spec", {"direction", "blocklist", "pii", "opa", "decode"})
    direction = _enum(Direction, spec.get("direction", "both"), "spec.direction")
    sensitive = _sensitive(sensitive_spec)
    rules = [
        *_blocklist(spec.get("blocklist", []), "spec.blocklist", direction),
        *_blocklist(sensitive.get("blocklist", []), "sensitive_spec.blocklist", direction),
    ]
    if len(rules) > MAX_RULES:
        raise ValidationFailed(f"a policy may have at most {MAX_RULES} blocklist rules", param="spec.blocklist")
    ids = [rule.id for rule in rules]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValidationFailed(f"blocklist rule ids must be unique; repeated: {duplicates}", param="spec.blocklist")
    opa = spec.get("opa")
    token = sensitive.get("opa_token")
    return GuardrailSpec(
        name=name,
        blocklist=tuple(rules),
        pii=_pii(spec.get("pii", {}), direction),
        opa=None if opa is None else _opa(opa, token),
        decode=_decode(spec.get("decode", [])),
    )


def _encodable(value: Any, param: str) -> Any:
    """``value`` itself, if it is not a string that cannot be encoded (a lone surrogate)."""
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            # RE2, rego-cpp and HTTP headers all take UTF-8: it would fail on every request, as a 500.
            raise ValidationFailed(
                f"{param} holds a lone UTF-16 surrogate, which is not a character", param=param
            ) from None
    return value


def _object(value: Any, param: str, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValidationFailed(f"{param} must be a JSON object", param=param)
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ValidationFailed(
            f"{param} has unknown field(s) {unknown}; allowed: {', '.join(sorted(allowed))}", param=param
        )
    return value


def _enum(kind: type[Action] | type[Direction], value: Any, param: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise ValidationFailed(f"{param} must be one of {choices}", param=param) from None


def _sensitive(sensitive_spec: str | None) -> Mapping[str, Any]:
    if sensitive_spec is None:
        return {}
    try:
        value = json.loads(sensitive_spec)
    except (TypeError, ValueError):
        # Never echo it: it is secret by definition.
        raise ValidationFailed("sensitive_spec must be a JSON object", param="sensitive_spec") from None
    _object(value, "sensitive_spec", {"blocklist", "opa_token"})
    token = _encodable(value.get("opa_token"), "sensitive_spec.opa_token")
    if token is not None and (not isinstance(token, str) or not token):
        raise ValidationFailed("sensitive_spec.opa_token must be a non-empty string", param="sensitive_spec.opa_token")
    return value


def _blocklist(rules: Any, param: str, default: Direction) -> list[BlocklistRule]:
    if not isinstance(rules, Sequence) or isinstance(rules, str):
        raise ValidationFailed(f"{param} must be a list of rules", param=param)
    out = []
    for i, rule in enumerate(rules):
        where = f"{param}[{i}]"
        _object(rule, where, {"id", "literal", "regex", "action", "direction", "match", "max_length"})
        # A rule without an id is named by its place: never by its text, which may be confidential.
        rule_id = rule.get("id", f"{param.split('.')[0]}-{i}")
        if not isinstance(rule_id, str) or not _RULE_ID.match(rule_id):
            raise ValidationFailed(
                f"{where}.id must be 1-64 characters of letters, digits, '_', '.', ':' and '-'", param=f"{where}.id"
            )
        if ("literal" in rule) == ("regex" in rule):
            raise ValidationFailed(f"{where} must have exactly one of 'literal' and 'regex'", param=where)
        action = _enum(Action, rule.get("action", "block"), f"{where}.action")
        direction = _enum(Direction, rule.get("direction", default), f"{where}.direction")
        match = rule.get("match", "word" if "literal" in rule else "substring")
        if match not in ("word", "substring"):
            raise ValidationFailed(f"{where}.match must be 'word' or 'substring'", param=f"{where}.match")
        if "literal" in rule:
            literal = normalize_literal(_encodable(rule["literal"], f"{where}.literal"), f"{where}.literal")
            word = match == "word"
            out.append(BlocklistRule(rule_id, action, direction, literal=literal, word=word, max_length=len(literal)))
            continue
        pattern = _encodable(rule["regex"], f"{where}.regex")
        compile_regex(pattern, f"{where}.regex")
        max_length = rule.get("max_length", regex_max_length(pattern) or DEFAULT_REGEX_MAX_LENGTH)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or not 1 <= max_length <= 4096:
            raise ValidationFailed(f"{where}.max_length must be an integer from 1 to 4096", param=f"{where}.max_length")
        word = match == "word"
        out.append(BlocklistRule(rule_id, action, direction, regex=pattern, word=word, max_length=max_length))
    return out


def _decode(value: Any) -> tuple[str, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str) or any(v not in DECODINGS for v in value):
        raise ValidationFailed(f"spec.decode must be a list of {', '.join(DECODINGS)}", param="spec.decode")
    return tuple(dict.fromkeys(value))


def _pii(value: Any, default: Direction) -> tuple[PiiRule, ...]:
    _object(value, "spec.pii", set(PII_TYPES))
    out = []
    for pii_type, setting in value.items():
        where = f"spec.pii.{pii_type}"
        if isinstance(setting, str):
            setting = {"mode": setting}
        _object(setting, where, {"mode", "direction"})
        if "mode" not in setting:
            raise ValidationFailed(f"{where}.mode is required (block, redact or log)", param=f"{where}.mode")
        action = _enum(Action, setting["mode"], f"{where}.mode")
        direction = _enum(Direction, setting.get("direction", default), f"{where}.direction")
        out.append(PiiRule(pii_type, action, direction))
    return tuple(out)


def _opa(value: Any, token: str | None) -> OpaSettings:
    _object(value, "spec.opa", {"engine", "rego", "query", "url", "path", "timeout_ms", "on_error"})
    try:
        engine = OpaEngine(value.get("engine", OpaEngine.EMBEDDED))
    except ValueError:
        raise ValidationFailed("spec.opa.engine must be 'embedded' or 'remote'", param="spec.opa.engine") from None
    timeout = value.get("timeout_ms", 100)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or not 1 <= timeout <= 10_000:
        raise ValidationFailed("spec.opa.timeout_ms must be an integer from 1 to 10000", param="spec.opa.timeout_ms")
    on_error = value.get("on_error", "deny")
    if on_error not in ("deny", "allow"):
        raise ValidationFailed(
            "spec.opa.on_error must be 'deny' (fail closed) or 'allow' (fail open)", param="spec.opa.on_error"
        )
    common: dict[str, Any] = {"engine": engine, "timeout_ms": timeout, "fail_open": on_error == "allow"}
    if engine is OpaEngine.EMBEDDED:
        for field in ("url", "path"):
            if field in value:
                raise ValidationFailed(f"spec.opa.{field} is for engine 'remote'", param=f"spec.opa.{field}")
        rego = _encodable(value.get("rego"), "spec.opa.rego")
        if not isinstance(rego, str) or not rego.strip() or len(rego) > MAX_REGO_LENGTH:
            raise ValidationFailed(
                f"spec.opa.rego must be Rego source of 1 to {MAX_REGO_LENGTH} characters", param="spec.opa.rego"
            )
        query = value.get("query", DEFAULT_OPA_QUERY)
        if not isinstance(query, str) or not _QUERY.match(query):
            raise ValidationFailed("spec.opa.query must look like data.<package>.<rule>", param="spec.opa.query")
        check_rego(rego, query)  # compiles it: a syntax error is refused here
        return OpaSettings(**common, rego=rego, query=query)
    for field in ("rego", "query"):
        if field in value:
            raise ValidationFailed(f"spec.opa.{field} is for engine 'embedded'", param=f"spec.opa.{field}")
    url = _encodable(value.get("url"), "spec.opa.url")
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ValidationFailed("spec.opa.url must be http(s)://host[:port] of the OPA server", param="spec.opa.url")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValidationFailed("spec.opa.url has an invalid port", param="spec.opa.url") from None
    if parts.username or parts.password:
        raise ValidationFailed(
            "spec.opa.url must not carry credentials; put a token in sensitive_spec.opa_token", param="spec.opa.url"
        )
    path = value.get("path")
    if not isinstance(path, str) or not _PATH.match(path):
        raise ValidationFailed(
            "spec.opa.path must look like <package>/<rule>, e.g. inferflux/guardrails/decision", param="spec.opa.path"
        )
    return OpaSettings(**common, url=url, path=path, token=token)
