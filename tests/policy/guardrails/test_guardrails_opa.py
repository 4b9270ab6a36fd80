"""OPA decisions, embedded (regopy) and remote (opa-python-client against a loopback OPA-compatible server)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from opa_server import LoopbackOpa
from servers import free_loopback_socket

from policy.guardrails import Guardrails, OpaDecision, PolicyDenied, PolicyEngineUnavailable, opa_input
from policy.rbac import Principal

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
    from policy.guardrails import parse_spec

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
