"""Planning a request for a model an upstream serves: one upstream request a choice, and its affinity key."""

from __future__ import annotations

from typing import Any

import pytest

from inferflux.gateway.pipeline.plan import Placement
from inferflux.gateway.pipeline.plan_remote import AFFINITY_CHARS, plan_remote
from inferflux.gateway.pipeline.protocol import ChatCompletionRequest, CompletionRequest

SYSTEM = "You are the support assistant of ACME. " * 40  # longer than AFFINITY_CHARS


@pytest.fixture(scope="module")
def served(fleet_model: Any) -> Any:
    return fleet_model


def chat_key(served: Any, tenant: str, *messages: tuple[str, str]) -> bytes:
    req = ChatCompletionRequest.model_validate({"model": "fleet", "messages": [{"role": r, "content": c} for r, c in messages]})
    plan = plan_remote(served, req, Placement(tenant=tenant))
    return plan.choices[0].request.affinity  # type: ignore[union-attr]


def test_one_applications_conversations_share_a_key_whatever_their_questions(served: Any) -> None:
    first = chat_key(served, "acme", ("system", SYSTEM), ("user", "Where is my order?"))
    second = chat_key(served, "acme", ("system", SYSTEM), ("user", "How do I reset my password?"),
                      ("assistant", "Like this."), ("user", "Thanks"))  # fmt: skip
    assert first == second
    assert chat_key(served, "globex", ("system", SYSTEM), ("user", "Where is my order?")) != first  # per tenant
    assert chat_key(served, "acme", ("system", "Another app."), ("user", "Where is my order?")) != first


def test_without_a_system_message_the_key_is_the_prompts_first_blocks(served: Any) -> None:
    opening = "x" * AFFINITY_CHARS
    a = chat_key(served, "acme", ("user", opening + " one"))
    b = chat_key(served, "acme", ("user", opening + " two"))
    c = chat_key(served, "acme", ("user", "y" + opening))
    assert a == b != c
    req = CompletionRequest.model_validate({"model": "fleet", "prompt": [opening + " one", opening + " two"]})
    plan = plan_remote(served, req, Placement(tenant="acme"))
    assert plan.choices[0].request.affinity == plan.choices[1].request.affinity  # type: ignore[union-attr]


def test_each_choice_is_one_upstream_request_in_the_upstreams_name(served: Any) -> None:
    req = ChatCompletionRequest.model_validate({"model": "fleet", "messages": [{"role": "user", "content": "hi"}],
                                                "n": 3, "seed": 7, "max_tokens": 5, "stop": "."})  # fmt: skip
    plan = plan_remote(served, req, Placement(tenant="acme", upstream_headers=(("traceparent", "00-ab-cd-01"),)))
    bodies = [c.request.body for c in plan.choices]  # type: ignore[union-attr]
    assert [b["seed"] for b in bodies] == [7, 8, 9]
    assert all(b["model"] == "up" and b["n"] == 1 and b["max_tokens"] == 5 and b["stop"] == ["."] for b in bodies)
    assert plan.choices[0].request.headers == {"traceparent": "00-ab-cd-01"}  # type: ignore[union-attr]
    assert plan.prompt_tokens == 3 * plan.prompts[0].num_tokens > 0
