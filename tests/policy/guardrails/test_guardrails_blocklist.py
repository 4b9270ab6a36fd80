"""Blocklist rules: RE2 only, bounded time on catastrophic patterns, clear refusals of bad patterns."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.guardrails import Guardrails, parse_spec
from inferflux.policy.guardrails.blocklist import MAX_PATTERN_LENGTH, compile_regex, regex_max_length
from inferflux.policy.guardrails import check as check_module
from inferflux.policy.guardrails.check import LiteralGroup, check_texts, scan_plan


def test_catastrophic_backtracking_pattern_returns_quickly(make_guardrails: Callable[..., Guardrails]) -> None:
    # With a backtracking engine (Python's re) this pattern on this text takes astronomically long.
    rules = [{"id": "evil", "regex": "(a+)+$"}, {"id": "evil2", "regex": "(a|aa)+b"}]
    guardrails = make_guardrails({"blocklist": rules})
    text = "a" * 50_000 + "!"
    started = time.monotonic()
    decision = guardrails.check_input([text])
    elapsed = time.monotonic() - started
    assert elapsed < 1.0, elapsed
    assert not decision.blocked  # the "!" at the end: neither pattern matches
    # ...and the rules are live: the same patterns do fire where they match.
    assert [f.rule for f in guardrails.check_input(["a" * 50_000]).findings] == ["blocklist.evil"]
    assert [f.rule for f in guardrails.check_input(["x aab"]).findings] == ["blocklist.evil2"]


def test_catastrophic_pattern_that_cannot_match_is_quick_too(make_guardrails: Callable[..., Guardrails]) -> None:
    guardrails = make_guardrails({"blocklist": [{"id": "evil", "regex": "^(a+)+$"}]})
    started = time.monotonic()
    decision = guardrails.check_input(["a" * 50_000 + "b"])
    assert time.monotonic() - started < 1.0
    assert not decision.blocked


@pytest.mark.parametrize(
    ("pattern", "fragment"),
    [
        ("(unclosed", "not a valid RE2 regex"),
        ("(?<=a)b", "not a valid RE2 regex"),  # look-behind: Python has it, RE2 does not
        (r"(a)\1", "not a valid RE2 regex"),  # back-reference
        ("a*", "matches the empty string"),
        ("x" * (MAX_PATTERN_LENGTH + 1), "1 to 1000 characters"),
        ("", "1 to 1000 characters"),
        ("((((a{1,100}){1,100}){1,100}){1,100})", "RE2"),
    ],
)
def test_bad_patterns_are_refused_with_the_field_named(pattern: str, fragment: str) -> None:
    with pytest.raises(ValidationFailed) as caught:
        parse_spec({"blocklist": [{"id": "ok", "literal": "x"}, {"id": "bad", "regex": pattern}]})
    assert caught.value.param == "spec.blocklist[1].regex"
    assert fragment in caught.value.message
    assert caught.value.status_code == 422


def test_regex_is_compiled_by_re2() -> None:
    assert type(compile_regex("a+b", "regex")).__module__ == "re2"


def test_literal_word_match_and_substring_match(make_guardrails: Callable[..., Guardrails]) -> None:
    word = make_guardrails({"blocklist": [{"id": "w", "literal": "ski"}]})
    sub = make_guardrails({"blocklist": [{"id": "s", "literal": "ski", "match": "substring"}]})
    assert not word.check_input(["skip skis askiing"]).blocked
    assert word.check_input(["skip skis ski"]).blocked  # a false start does not hide a later match
    assert sub.check_input(["skip"]).blocked


def test_literal_next_to_non_ascii_letters(make_guardrails: Callable[..., Guardrails]) -> None:
    word = make_guardrails({"blocklist": [{"id": "w", "literal": "ski"}]})
    assert not word.check_input(["éskié"]).blocked
    assert word.check_input(["é ski é"]).blocked


def test_redact_and_log_actions(make_guardrails: Callable[..., Guardrails]) -> None:
    guardrails = make_guardrails(
        {
            "blocklist": [
                {"id": "r", "literal": "secret plan", "action": "redact"},
                {"id": "l", "literal": "acme", "action": "log"},
            ]
        }
    )
    decision = guardrails.check_input(["The SECRET  PLAN of ACME"])
    assert not decision.blocked
    assert decision.texts == ("The [REDACTED] of ACME",)
    assert [(f.rule, f.action.value) for f in decision.findings] == [("blocklist.r", "redact"), ("blocklist.l", "log")]


def test_direction_limits_a_rule(make_guardrails: Callable[..., Guardrails]) -> None:
    guardrails = make_guardrails({"blocklist": [{"id": "o", "literal": "ski", "direction": "output"}]})
    assert not guardrails.check_input(["ski"]).blocked
    assert guardrails.check_output("ski").blocked


def test_sensitive_rules_apply_and_are_named_by_id_only(make_guardrails: Callable[..., Guardrails]) -> None:
    guardrails = make_guardrails({}, '{"blocklist": [{"literal": "bluebird"}]}')
    decision = guardrails.check_input(["project Bluebird"])
    assert decision.blocked
    assert "bluebird" not in " ".join(decision.reasons).lower()
    assert "bluebird" not in decision.error().message.lower()


@pytest.mark.parametrize(("pattern", "expected"), [("abc", 3), ("a{2,5}b", 6), ("a+", None), (r"\pL", None)])
def test_regex_max_length(pattern: str, expected: int | None) -> None:
    assert regex_max_length(pattern) == expected


@pytest.mark.parametrize("budget", [0, 10**9], ids=["re2-set", "plain-search"])
def test_many_literals_share_one_gate_and_find_what_each_alone_finds(
    make_guardrails: Callable[..., Guardrails], monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    # One search decides which of a tenant's words occur (the RE2 set's, or a plain one for a short text):
    # neither may change a single finding.
    monkeypatch.setattr(check_module, "PLAIN_SEARCH_BUDGET", budget)
    words = [f"word{i}x" for i in range(300)] + ["a.b", "c++", "zürich", "two words"]
    rules = [{"id": f"r{i}", "literal": w, "action": "redact"} for i, w in enumerate(words)]
    rules.append({"id": "sub", "literal": "ski", "match": "substring"})
    # A regex on the same spans as a literal before it: the gate moves the literals after it; the
    # findings must come in the same order all the same.
    rules.append({"id": "re7", "regex": "word7x", "match": "word", "action": "redact"})
    guardrails = make_guardrails({"blocklist": rules, "pii": {"email": "redact"}})
    plan = scan_plan(guardrails.input_matchers)
    assert sum(isinstance(entry, LiteralGroup) for entry in plan) == 1  # the literals went behind one gate
    texts = [
        "nothing to see here",
        "say WORD7X and word299x",
        "inside aword7xb and word7x_ no",  # glued to word characters: not a word match
        "w\u200bord12x via zero width, ＷＯＲＤ13Ｘ full width",
        "a.b and c++ in Zürich, two  words, two words",
        "skipping a ski trip: me@example.com",
    ]
    gated = check_texts(texts, plan)
    alone = check_texts(texts, guardrails.input_matchers)  # every matcher on its own, no gate
    assert gated == alone
    found = {f.rule for f in gated.findings}
    assert {"blocklist.r7", "blocklist.r299", "blocklist.r12", "blocklist.r13", "blocklist.r300", "blocklist.r301",
            "blocklist.r302", "blocklist.r303", "blocklist.sub", "blocklist.re7", "pii.email"} <= found
    assert gated.texts[0] == texts[0] and "aword7xb" in gated.texts[2] and "[REDACTED]" not in gated.texts[2]


def test_a_gate_for_a_single_literal_is_not_built(make_guardrails: Callable[..., Guardrails]) -> None:
    guardrails = make_guardrails({"blocklist": [{"id": "w", "literal": "ski"}]})
    assert scan_plan(guardrails.input_matchers) == tuple(guardrails.input_matchers)
