"""OPA decisions, embedded (regopy) and remote (opa-python-client against a loopback OPA-compatible server)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from opa_server import LoopbackOpa
from servers import free_loopback_socket

from inferflux.policy.guardrails import Guardrails, OpaDecision, PolicyDenied, PolicyEngineUnavailable, opa_input
from inferflux.policy.guardrails import opa_watchdog
from inferflux.policy.guardrails.errors import OpaError
from inferflux.policy.guardrails.opa import EmbeddedRego
from inferflux.policy.guardrails.rego import load_regopy, prepare_input
from inferflux.policy.guardrails.opa_cache import DecisionCache
from inferflux.policy.guardrails.spec import OpaSettings
from inferflux.policy.guardrails.rego_input import expressions, set_input
from inferflux.policy.rbac import Principal

REGO = """
package inferflux.guardrails
import rego.v1

default decision := {"allow": true, "reasons": []}
decision := {"allow": false, "reasons": sort(reasons)} if count(reasons) > 0

reasons contains "viewers may not use model big" if {
    input.model == "big"
    "viewer" in input.roles
}
reasons contains "prompt longer than 1000 tokens" if input.tokens.prompt > 1000
reasons contains sprintf("%s found in the prompt", [f.type]) if {
    some f in input.findings
    f.kind == "pii"
}
"""
STRICT = REGO.replace("if input.tokens.prompt > 1000", "if input.tokens.prompt > 10")
PATH = "inferflux/guardrails/decision"
VIEWER = Principal("ten_1", "acme", "key:abcdefghijkl", "api_key", frozenset({"viewer"}), key_id="key_1")


def document(model: str = "small", prompt_tokens: int = 5, findings: Any = ()) -> dict[str, Any]:
    route = "/v1/chat/completions"
    return opa_input(
        VIEWER, model=model, route=route, prompt_tokens=prompt_tokens, max_completion_tokens=64, findings=findings
    )


def decide(guardrails: Guardrails, doc: dict[str, Any]) -> OpaDecision:
    async def run() -> OpaDecision:
        try:
            return await guardrails.authorize(doc)
        finally:
            await guardrails.aclose()

    return asyncio.run(run())


def put_policy(opa: LoopbackOpa, source: str) -> None:
    httpx.put(f"{opa.url}/v1/policies/guardrails", content=source, timeout=5).raise_for_status()


def remote(url: str, **extra: Any) -> dict[str, Any]:
    return {"opa": {"engine": "remote", "url": url, "path": PATH, "timeout_ms": 1000, **extra}}


def test_input_document_carries_no_text() -> None:
    doc = document(findings=[])
    assert doc["tenant"] == {"id": "ten_1", "name": "acme"}
    assert doc["roles"] == ["viewer"] and doc["scopes"] == ["read"]
    assert doc["tokens"] == {"prompt": 5, "max_completion": 64}


# -- embedded


def test_embedded_allow_and_deny_with_reasons(make_guardrails: Callable[..., Guardrails]) -> None:
    guardrails = make_guardrails({"opa": {"rego": REGO}}, name="access")
    assert decide(guardrails, document()).allowed
    denied = decide(guardrails, document(model="big", prompt_tokens=5000))
    assert not denied.allowed and denied.error is None
    assert denied.reasons == ("prompt longer than 1000 tokens", "viewers may not use model big")
    with pytest.raises(PolicyDenied) as caught:
        denied.raise_for_deny()
    assert caught.value.status_code == 403 and caught.value.code == "policy_denied"
    assert "viewers may not use model big" in caught.value.message and "'access'" in caught.value.message


def test_guardrail_findings_reach_the_policy(make_guardrails: Callable[..., Guardrails]) -> None:
    guardrails = make_guardrails({"pii": {"email": "log"}, "opa": {"rego": REGO}})
    decision = guardrails.check_input(["mail me at bob@example.com"])
    assert decision.allowed
    verdict = decide(guardrails, document(findings=decision.findings))
    assert verdict.reasons == ("email found in the prompt",)


@pytest.mark.parametrize("name", ["Zürich AG", 'say "hi"', "back\\slash", "tab\there", "東京", "emoji 🙂"])
def test_embedded_strings_equal_the_policy_literals(make_guardrails: Callable[..., Guardrails], name: str) -> None:
    # rego-cpp compares strings in their escaped form: a tenant name with a
    # quote, a backslash or non-ASCII letters must still equal the same name
    # written in the policy (JSON input text would carry "\u00fc" for "ü").
    literal = json.dumps(name, ensure_ascii=False)
    rego = f"package inferflux.guardrails\nimport rego.v1\ndefault decision := false\ndecision if input.tenant.name == {literal}\n"
    principal = Principal("ten_1", name, "key:abcdefghijkl", "api_key", frozenset({"member"}), key_id="key_1")
    doc = opa_input(principal, model="m", route="/v1/completions", prompt_tokens=1)
    assert decide(make_guardrails({"opa": {"rego": rego}}), doc).allowed
    other = opa_input(replace(principal, tenant_name=name + "x"), model="m", route="/v1/completions", prompt_tokens=1)
    assert not decide(make_guardrails({"opa": {"rego": rego}}), other).allowed


@pytest.mark.parametrize(
    "doc",
    [
        document(findings=[]),
        {"s": 'quote " backslash \\ newline \n tab \t nul \x00 del \x7f', "ü": "Zürich 東京 🙂"},
        {"ints": [0, -1, 2**63 - 1, -(2**63)], "floats": [0.5, -1e300], "flags": [True, False, None]},
        {"empty": {}, "none": [], "nested": {"a": [{"b": [[], {}]}]}},
        "a bare string",
        [1, "two", {"three": 3}],
    ],
)
def test_input_built_by_the_c_api_reads_back_as_the_document(doc: Any) -> None:
    regopy = load_regopy()
    interpreter = regopy.Interpreter()
    prepared = prepare_input(doc)  # held while the interpreter points into it
    set_input(regopy, interpreter, prepared)
    output = interpreter.query("x := input")
    assert output.ok(), str(output)
    assert output.results[0].bindings["x"] == doc


@pytest.mark.parametrize(
    "doc",
    [
        {"n": float("nan")},
        {"n": float("inf")},
        {"n": 2**64},
        {1: "a key that is not a string"},
        {"s": "lone surrogate \ud800"},
        {"deep": functools.reduce(lambda inner, _: [inner], range(40), [])},
        {"set": {1, 2}},
    ],
)
def test_input_json_cannot_carry_is_an_opa_error(doc: Any) -> None:
    with pytest.raises(OpaError, match="evaluation failed"):
        prepare_input(doc)


def test_embedded_input_rejects_what_json_cannot_carry(make_guardrails: Callable[..., Guardrails]) -> None:
    guardrails = make_guardrails({"opa": {"rego": REGO, "on_error": "deny"}})
    doc = {**document(), "tokens": {"prompt": float("nan"), "max_completion": 1}}
    verdict = decide(guardrails, doc)
    assert not verdict.allowed and verdict.error is not None and "evaluation failed" in verdict.error


@pytest.mark.parametrize(
    ("rule", "allowed", "reasons"),
    [
        ("decision := true", True, ()),
        ("decision := false", False, ()),
        ('decision := {"allow": false, "deny": ["no"]}', False, ("no",)),
        ("other := true", False, ("the policy gave no decision for this request",)),  # undefined: default deny
    ],
)
def test_embedded_answer_shapes(
    make_guardrails: Callable[..., Guardrails], rule: str, allowed: bool, reasons: tuple[str, ...]
) -> None:
    guardrails = make_guardrails({"opa": {"rego": f"package inferflux.guardrails\nimport rego.v1\n{rule}\n"}})
    verdict = decide(guardrails, document())
    assert (verdict.allowed, verdict.reasons, verdict.error) == (allowed, reasons, None)


@pytest.mark.parametrize(("on_error", "allowed"), [("deny", False), ("allow", True)])
def test_embedded_bad_answer_fails_open_or_closed(
    make_guardrails: Callable[..., Guardrails], on_error: str, allowed: bool
) -> None:
    rego = 'package inferflux.guardrails\nimport rego.v1\ndecision := "yes"\n'
    verdict = decide(make_guardrails({"opa": {"rego": rego, "on_error": on_error}}), document())
    assert verdict.allowed is allowed and verdict.error
    if not allowed:
        with pytest.raises(PolicyEngineUnavailable) as caught:
            verdict.raise_for_deny()
        assert caught.value.status_code == 503


def test_every_policy_must_allow() -> None:
    from inferflux.policy.guardrails import parse_spec

    lenient = parse_spec({"opa": {"rego": REGO}}, name="lenient")
    strict = parse_spec({"opa": {"rego": STRICT}}, name="strict")
    verdict = decide(Guardrails([lenient, strict]), document(prompt_tokens=50))
    assert not verdict.allowed and verdict.policy == "strict"
    assert decide(Guardrails([lenient, strict]), document(prompt_tokens=5)).allowed


# -- remote, over the wire


def test_remote_allow_and_deny_with_reasons(opa: LoopbackOpa, make_guardrails: Callable[..., Guardrails]) -> None:
    put_policy(opa, REGO)
    guardrails = make_guardrails(remote(opa.url))
    assert decide(guardrails, document()).allowed
    denied = decide(guardrails, document(model="big"))
    assert (denied.allowed, denied.reasons, denied.error) == (False, ("viewers may not use model big",), None)
    assert opa.requests[-1]["input"]["model"] == "big"  # the input document went over the wire


def test_remote_policy_edit_takes_effect_without_restart(
    opa: LoopbackOpa, make_guardrails: Callable[..., Guardrails]
) -> None:
    put_policy(opa, REGO)
    guardrails = make_guardrails(remote(opa.url))

    async def both() -> tuple[OpaDecision, OpaDecision]:
        before = await guardrails.authorize(document(prompt_tokens=50))
        await asyncio.to_thread(put_policy, opa, STRICT)
        after = await guardrails.authorize(document(prompt_tokens=50))
        await guardrails.aclose()
        return before, after

    before, after = asyncio.run(both())
    assert before.allowed
    assert not after.allowed and after.reasons == ("prompt longer than 1000 tokens",)


def test_remote_undefined_document_is_a_deny(opa: LoopbackOpa, make_guardrails: Callable[..., Guardrails]) -> None:
    put_policy(opa, REGO)
    verdict = decide(make_guardrails(remote(opa.url, path="inferflux/guardrails/nothing")), document())
    assert not verdict.allowed and verdict.error is None


@pytest.mark.parametrize(("on_error", "allowed"), [("deny", False), ("allow", True)])
def test_remote_server_down(make_guardrails: Callable[..., Guardrails], on_error: str, allowed: bool) -> None:
    sock = free_loopback_socket()
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    verdict = decide(make_guardrails(remote(f"http://127.0.0.1:{port}", on_error=on_error)), document())
    assert verdict.allowed is allowed
    assert verdict.error and "cannot be reached" in verdict.error


def test_remote_slow_server_times_out(opa: LoopbackOpa, make_guardrails: Callable[..., Guardrails]) -> None:
    put_policy(opa, REGO)
    opa.delay = 3.0
    guardrails = make_guardrails(remote(opa.url, timeout_ms=200))
    started = time.monotonic()
    verdict = decide(guardrails, document())
    assert time.monotonic() - started < 2.0
    assert not verdict.allowed and verdict.error and "timed out" in verdict.error


def test_remote_bearer_token_from_sensitive_spec(opa: LoopbackOpa, make_guardrails: Callable[..., Guardrails]) -> None:
    put_policy(opa, REGO)
    opa.token = "s3cret-token"
    with_token = make_guardrails(remote(opa.url), '{"opa_token": "s3cret-token"}')
    assert decide(with_token, document()).allowed
    without = decide(make_guardrails(remote(opa.url)), document())
    assert not without.allowed and without.error == "the OPA server answered 401"


def slow_rego(n: int) -> str:
    """A policy whose evaluation takes time that grows with ``n`` (~8 ms at 2,000 on the CI machine)."""
    return f"""
package inferflux.guardrails
import rego.v1
default decision := {{"allow": false}}
decision := {{"allow": true}} if {{ count([x | some x in numbers.range(1, {n}); x % 7 == 0]) > 0 }}
"""


def drain_opa_pool() -> None:
    """Wait until every thread of the OPA pool is free: an evaluation that timed out still runs to its end,
    and its CPU would count against the next test's timeouts."""
    workers = opa_watchdog.POOL_THREADS
    barrier = threading.Barrier(workers + 1)
    for _ in range(workers):
        opa_watchdog._POOL.submit(barrier.wait, 60)
    barrier.wait(60)


@pytest.mark.parametrize(("on_error", "allowed"), [("deny", False), ("allow", True)])
def test_embedded_slow_policy_times_out(
    make_guardrails: Callable[..., Guardrails], on_error: str, allowed: bool
) -> None:
    spec = {"opa": {"engine": "embedded", "rego": slow_rego(200_000), "timeout_ms": 20, "on_error": on_error}}
    guardrails = make_guardrails(spec)  # compiled (and regopy, with torch, loaded) before the clock starts
    start = time.monotonic()
    decision = decide(guardrails, document())
    assert time.monotonic() - start < 0.5  # the answer does not wait for the evaluation
    assert decision.allowed is allowed
    assert decision.error is not None and "timed out after 20 ms" in decision.error
    drain_opa_pool()


def stalled(engine: EmbeddedRego, seconds: float) -> None:
    """Make ``engine``'s evaluations wait ``seconds`` off the CPU first, as a thread kept from the GIL
    or from a core by a busy gateway does."""
    ask = engine._ask

    def slow_ask(*args: Any) -> Any:
        time.sleep(seconds)
        return ask(*args)

    engine._ask = slow_ask  # type: ignore[method-assign]


@pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="this platform cannot read a thread's CPU time")
def test_an_evaluation_kept_waiting_by_a_busy_gateway_is_not_timed_out(
    make_guardrails: Callable[..., Guardrails],
) -> None:
    # A decision of well under a millisecond of CPU that waits 150 ms for the GIL and a core: the
    # 50 ms timeout is the policy's CPU time, so it decides; counted in wall time it failed closed.
    guardrails = make_guardrails({"opa": {"engine": "embedded", "rego": REGO, "timeout_ms": 50, "on_error": "deny"}})
    (engine,) = guardrails.engines
    engine.cache = DecisionCache(None)  # every decision evaluated
    stalled(engine, 0.15)
    decision = decide(guardrails, document())
    assert decision == OpaDecision(True, (), "p")


@pytest.mark.parametrize(("on_error", "allowed"), [("deny", False), ("allow", True)])
def test_an_evaluation_waiting_past_the_wall_bound_fails_as_the_policy_says(
    make_guardrails: Callable[..., Guardrails], monkeypatch: pytest.MonkeyPatch, on_error: str, allowed: bool
) -> None:
    monkeypatch.setattr(opa_watchdog, "RUN_SECONDS", 0.2)
    spec = {"opa": {"engine": "embedded", "rego": REGO, "timeout_ms": 50, "on_error": on_error}}
    guardrails = make_guardrails(spec)
    (engine,) = guardrails.engines
    stalled(engine, 1.0)
    start = time.monotonic()
    decision = decide(guardrails, document())
    assert time.monotonic() - start < 0.8  # answered at the bound, not when the evaluation ends
    assert decision.allowed is allowed
    assert decision.error is not None and "no decision within 0.2 s (the gateway is overloaded)" in decision.error
    drain_opa_pool()


def test_an_evaluation_whose_thread_clock_cannot_be_read_times_out(
    make_guardrails: Callable[..., Guardrails], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Read from the loop, the clock of a thread that is gone raises: the request must not wait for an answer
    # that will not come. The evaluating thread itself can always read its own clock.
    def own_clock_only() -> Callable[[], float]:
        owner = threading.get_ident()

        def clock() -> float:
            if threading.get_ident() != owner:
                raise OSError(22, "Invalid argument")
            return time.thread_time()

        return clock

    monkeypatch.setattr(opa_watchdog, "thread_cpu_clock", own_clock_only)
    guardrails = make_guardrails({"opa": {"engine": "embedded", "rego": REGO, "timeout_ms": 50, "on_error": "deny"}})
    (engine,) = guardrails.engines
    stalled(engine, 0.5)
    start = time.monotonic()
    decision = decide(guardrails, document())
    assert time.monotonic() - start < 0.4
    assert not decision.allowed and decision.error is not None and "timed out after 50 ms" in decision.error
    drain_opa_pool()


def test_an_inline_policy_decides_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = OpaSettings(engine="embedded", timeout_ms=100, fail_open=False, rego=REGO)
    engine = EmbeddedRego("inline", settings, inline=True)
    guardrails = Guardrails([], [engine])
    assert guardrails.inline_engines == (engine,) and guardrails.deferred_engines == ()
    monkeypatch.setattr(opa_watchdog._POOL, "submit", None)  # any hand-off to the pool would fail
    allowed = guardrails.authorize_inline(document())
    denied = guardrails.authorize_inline(document(model="big", prompt_tokens=5000))
    assert allowed == OpaDecision(True, (), "inline")
    assert not denied.allowed and denied.error is None
    assert denied.reasons == ("prompt longer than 1000 tokens", "viewers may not use model big")
    assert decide(guardrails, document(model="big")).reasons == ("viewers may not use model big",)


@pytest.mark.parametrize(("on_error", "allowed"), [("deny", False), ("allow", True)])
def test_an_inline_policy_past_its_timeout_counts_as_timed_out(on_error: str, allowed: bool) -> None:
    # Nothing stops an inline evaluation; once it ends past the timeout, on_error decides.
    settings = OpaSettings(engine="embedded", timeout_ms=1, fail_open=on_error == "allow", rego=slow_rego(20_000))
    decision = EmbeddedRego("slow", settings, inline=True).decide_now(document())
    assert decision.allowed is allowed
    assert decision.error is not None and "past its 1 ms timeout" in decision.error


def test_inline_and_awaited_policies_combine(make_guardrails: Callable[..., Guardrails]) -> None:
    inline = EmbeddedRego("global", OpaSettings(engine="embedded", timeout_ms=100, fail_open=False, rego=REGO),
                          inline=True)
    tenant = make_guardrails({"opa": {"engine": "embedded", "rego": STRICT}}, name="tenant")
    both = Guardrails([], [inline, *tenant.engines])
    assert both.deferred_engines == tenant.engines
    assert decide(both, document()).policy == "global,tenant"
    strict = decide(both, document(prompt_tokens=50))  # only the tenant's stricter policy refuses
    assert not strict.allowed and strict.policy == "tenant"


def test_embedded_decisions_queue_without_counting_against_the_timeout(
    make_guardrails: Callable[..., Guardrails],
) -> None:
    # 48 decisions at once of a policy that takes a few ms: more work than the
    # timeout in total, but each evaluation is well inside it. None may fail.
    spec = {"opa": {"engine": "embedded", "rego": slow_rego(2_000), "timeout_ms": 100, "on_error": "deny"}}
    guardrails = make_guardrails(spec)
    drain_opa_pool()  # no other test's evaluation still running beside these

    async def run() -> list[OpaDecision]:
        try:
            return await asyncio.gather(*(guardrails.authorize(document()) for _ in range(48)))
        finally:
            await guardrails.aclose()

    decisions = asyncio.run(run())
    assert [d.error for d in decisions if d.error] == []
    assert all(d.allowed for d in decisions)


@pytest.mark.slow
def test_regopy_loads_after_the_native_libraries_it_must_follow() -> None:
    # regopy's library loaded before re2's or torch's corrupts the heap (an abort
    # at their load); load_regopy orders them. A fresh interpreter under glibc's
    # strict heap checks, interleaving all three.
    script = (
        "import json\n"
        "from inferflux.policy.guardrails.rego import load_regopy\n"
        "regopy = load_regopy()\n"
        "import re2, torch\n"
        "for i in range(50):\n"
        "    it = regopy.Interpreter()\n"
        "    it.add_module('p.rego', f'package x\\ndefault allow := false\\nallow if {{ input.n > {i} }}')\n"
        "    it.set_input_term(json.dumps({'n': i + 1}))\n"
        "    out = it.query_bundle_entrypoint(it.build(None, ['x/allow']), 'x/allow')\n"
        "    options = re2.Options()\n"
        "    options.log_errors = False\n"
        "    re2.compile(f'[a-z]{{2,{i + 3}}}@example', options)\n"
        "print(out.ok(), torch.ones(2).sum().item())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[3], env={**os.environ, "MALLOC_CHECK_": "3"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "2.0"]


def test_nothing_imports_regopy_but_load_regopy() -> None:
    root = Path(__file__).resolve().parents[3]
    offenders = [
        str(path.relative_to(root))
        for top in ("policy", "gateway", "backends", "tests")
        for path in (root / top).rglob("*.py")
        if path not in (root / "policy" / "guardrails" / "rego.py", Path(__file__).resolve())
        and "import regopy" in path.read_text()
    ]
    assert offenders == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("undefined", []),
        ('{"expressions":[{"allow":false, "reasons":["x"]}]}', [{"allow": False, "reasons": ["x"]}]),
        ('[{"expressions":[true]}, {"expressions":[false]}]', [True]),  # several results: the first
        ('{"expressions":[]}', []),
    ],
)
def test_query_output_is_read_as_the_first_results_expressions(text: str, expected: list[Any]) -> None:
    assert expressions(text) == expected


@pytest.mark.parametrize("text", ["", "{", '{"bindings":{}}', '{"expressions":7}', "42"])
def test_unreadable_query_output_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        expressions(text)
