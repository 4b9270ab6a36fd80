"""Remembered decisions of embedded Rego policies: when a policy may be cached, and that a cached answer is right."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_guardrails_opa import REGO, document

from inferflux.policy.guardrails import Guardrails, OpaDecision
from inferflux.policy.guardrails.opa import EmbeddedRego
from inferflux.policy.guardrails.opa_cache import DecisionCache, cacheable_fields
from inferflux.policy.guardrails.spec import OpaSettings

HEAD = "package inferflux.guardrails\nimport rego.v1\n"


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        ('decision if input.model == "small"', {"model"}),
        ('decision if { input . model == "small"; "admin" in input.roles }', {"model", "roles"}),
        ("decision if input.tokens.prompt < 10", {"tokens"}),
        ("decision := true", set()),
        ('import input.model as m\ndecision if m == "small"', {"model"}),
        # a word in a string or a comment is not a use, nor a call
        ('decision := {"allow": true, "reasons": ["input was fine; print(x)"]} # input[0], time.now_ns()', set()),
        ('decision if input.model == `input`', {"model"}),
        ('decision if data.input.model == "x"', set()),  # a field named input, of something else
        ('my_input := 1\ndecision if my_input == 1', set()),
        # the whole document, or a part chosen at run time: could read anything
        ("decision if count(input) > 0", None),
        ('decision if input["model"] == "small"', None),
        ('decision if { some k; input[k] == "small" }', None),
        ('decision if object.get(input, "model", "") == "small"', None),
        ('decision if walk(input, [p, v])', None),
        ('decision if data.inferflux.guardrails.ok with input as {"model": "small"}', None),
        # answers that change with the clock, chance, the network or the runtime, or calls made for their effect
        ("decision if time.now_ns() > 0", None),
        ('decision if rand.intn("x", 10) < 5', None),
        ("decision if uuid.rfc4122(input.model) != \"\"", None),
        ('decision if opa.runtime().env.X == "1"', None),
        ('decision if http.send({"method": "get", "url": "http://x"}).status_code == 200', None),
        ('decision if io.jwt.decode_verify(input.model, {"secret": "s"})[0]', None),
        ('decision if { print(input.model); true }', None),
    ],
)
def test_which_policies_may_be_cached(body: str, fields: set[str] | None) -> None:
    found = cacheable_fields(HEAD + body + "\n")
    assert (None if found is None else set(found)) == fields


def test_the_test_policy_reads_four_fields() -> None:
    assert cacheable_fields(REGO) == {"model", "roles", "tokens", "findings"}


def counting(engine: EmbeddedRego) -> list[int]:
    """Count the engine's real evaluations (``_ask``), on any thread."""
    calls = [0]
    ask = engine._ask

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return ask(*args)

    engine._ask = counted  # type: ignore[method-assign]
    return calls


def engine_for(rego: str, *, inline: bool = True) -> EmbeddedRego:
    return EmbeddedRego("p", OpaSettings(engine="embedded", timeout_ms=1000, fail_open=False, rego=rego), inline=inline)


def test_an_inline_policy_is_evaluated_once_per_distinct_read_values() -> None:
    engine = engine_for(REGO)
    calls = counting(engine)
    small = engine.decide_now(document())
    again = engine.decide_now({**document(), "request_id": "req_other", "route": "/v1/completions"})  # unread fields
    big = engine.decide_now({**document(model="big"), "request_id": "req_3"})
    assert small == again == OpaDecision(True, (), "p")
    assert big == OpaDecision(False, ("viewers may not use model big",), "p")
    assert engine.decide_now(document(model="big")) == big
    assert calls[0] == 2 and (engine.cache.hits, engine.cache.misses) == (2, 2)


def test_a_pool_policy_is_cached_too() -> None:
    engine = engine_for(REGO, inline=False)
    calls = counting(engine)
    guardrails = Guardrails([], [engine])

    async def run() -> list[OpaDecision]:
        try:
            return [await guardrails.authorize(document(prompt_tokens=n)) for n in (5, 5, 5000, 5000)]
        finally:
            await guardrails.aclose()

    decisions = asyncio.run(run())
    assert [d.allowed for d in decisions] == [True, True, False, False]
    assert decisions[2].reasons == ("prompt longer than 1000 tokens",)
    assert calls[0] == 2


def test_a_policy_that_may_read_anything_is_evaluated_every_time() -> None:
    engine = engine_for(HEAD + 'default decision := false\ndecision if object.get(input, "model", "") == "small"\n')
    calls = counting(engine)
    assert all(engine.decide_now(document()).allowed for _ in range(3))
    assert calls[0] == 3 and not engine.cache.enabled


def test_a_missing_field_and_a_null_one_are_different_keys() -> None:
    engine = engine_for(HEAD + "default decision := false\ndecision if input.model == null\n")
    with_null = {**document(), "model": None}
    without = {k: v for k, v in document().items() if k != "model"}
    assert engine.decide_now(with_null).allowed
    assert not engine.decide_now(without).allowed  # not the remembered answer for null
    assert engine.decide_now(with_null).allowed


def test_failed_evaluations_are_not_remembered() -> None:
    engine = engine_for(HEAD + 'decision := "yes"\n')  # neither a boolean nor a decision object
    calls = counting(engine)
    first, second = engine.decide_now(document()), engine.decide_now(document())
    assert first.error is not None and second.error is not None and not second.allowed
    assert calls[0] == 2


def test_a_document_json_cannot_carry_is_evaluated_not_keyed() -> None:
    engine = engine_for(REGO)
    decision = engine.decide_now({**document(), "model": float("nan")})
    assert not decision.allowed and decision.error is not None  # the evaluation refuses it, as without a cache


def test_the_cache_stays_bounded() -> None:
    cache = DecisionCache(frozenset({"n"}), max_entries=8)
    for n in range(100):
        cache.put(cache.key({"n": n}), (True, ()))
        assert len(cache._answers) <= 8
    assert cache.get(cache.key({"n": 99})) == (True, ())
