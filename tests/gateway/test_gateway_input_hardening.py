"""Hostile input never reaches a 500 (issue 18, classes 1 and 9).

Every JSON body goes through one decoder with limits (depth, integer digits,
string and array lengths) and Unicode rules (no lone surrogates; no NUL where
the store would keep it), answered 400 naming the JSON path. Guardrails are
validated as they will be compiled, so nothing that fails on read is stored;
a stored policy that still cannot be used (written by an older version) answers
503 ``policy_unusable`` naming it, and an admin can still list, read and delete
it. Stop sequences are bounded in number and bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from starlette.testclient import TestClient

from admin_seed import Seeded, seeded_app
from http_helpers import bearer, error_of

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON_HEADERS = {"content-type": "application/json"}


@dataclass
class World(Seeded):
    app: Any
    client: TestClient
    member: dict[str, str]  # acme's member key
    other_member: dict[str, str]  # globex's


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    data_dir: Path = tmp_path_factory.mktemp("input-hardening")
    limits = {"json_max_depth": 16, "json_max_string_length": 4096, "json_max_array_length": 64}
    with seeded_app(lambda store, **kw: make_app(store, input_limits=limits, **kw), data_dir) as (seeded, app, client):
        _, member = seeded.store.create_api_key(seeded.acme.id, "hardening", "member")
        _, other = seeded.store.create_api_key(seeded.globex.id, "hardening", "member")
        yield World(**seeded.seeded(), app=app, client=client, member=bearer(member), other_member=bearer(other))


def raw(world: World, method: str, url: str, body: str | bytes, headers: dict[str, str]) -> Any:
    content = body.encode() if isinstance(body, str) else body
    return world.client.request(method, url, content=content, headers={**JSON_HEADERS, **headers})


def assert_400(response: Any, param: str | None, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def chat_body(content: str = "Hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1, **extra}


# -- the decoder --------------------------------------------------------------------------


def test_a_lone_surrogate_in_a_prompt_is_a_400_naming_the_field(world: World) -> None:
    chat = '{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 1}' % MODEL
    assert_400(raw(world, "POST", CHAT, chat, world.member), "messages[0].content", "invalid_unicode")
    completion = '{"model": "%s", "prompt": ["ok", "\\udfff"], "max_tokens": 1}' % MODEL
    assert_400(raw(world, "POST", COMPLETIONS, completion, world.member), "prompt[1]", "invalid_unicode")
    key = '{"model": "%s", "prompt": "ok", "\\ud800": 1}' % MODEL
    assert_400(raw(world, "POST", COMPLETIONS, key, world.member), None, "invalid_unicode")
    # A surrogate pair is one character, and fine.
    pair = '{"model": "%s", "prompt": "smile \\ud83d\\ude00", "max_tokens": 1}' % MODEL
    assert raw(world, "POST", COMPLETIONS, pair, world.member).status_code == 200


def test_a_huge_integer_is_a_400_on_every_json_route(world: World) -> None:
    digits = "9" * 5000  # past Python's int-conversion limit (4300 digits)
    cases = [
        (CHAT, world.member, '{"model": "%s", "messages": [{"role": "user", "content": "x"}], "seed": %s}'
         % (MODEL, digits), "seed"),
        (COMPLETIONS, world.member, '{"model": "%s", "prompt": [1, 2, %s]}' % (MODEL, digits), "prompt[2]"),
        ("/admin/v1/tenants", world.admin, '{"name": "t", "allowed_models": [%s]}' % digits, "allowed_models[0]"),
        (f"/admin/v1/tenants/{world.acme.id}/keys", world.acme_admin,
         '{"name": "k", "role": "member", "expires_in_seconds": %s}' % digits, "expires_in_seconds"),
        ("/admin/v1/guardrails", world.acme_admin, '{"name": "g", "spec": {"pii": %s}}' % digits, "spec.pii"),
    ]
    for url, headers, body, param in cases:
        assert_400(raw(world, "POST", url, body, headers), param, "integer_too_long")
    # 65 digits is past the configured default of 64, but Python would convert it.
    assert_400(raw(world, "POST", COMPLETIONS, '{"model": "m", "prompt": "x", "seed": 1%s}' % ("0" * 64),
                   world.member), "seed", "integer_too_long")


@pytest.mark.parametrize(
    ("literal", "param", "code"),
    [
        ("NaN", "response_format.strict", "number_out_of_range"),
        ("-Infinity", "response_format.strict", "number_out_of_range"),
        ("1e400", "response_format.strict", "number_out_of_range"),
        ("-1e999", "response_format.strict", "number_out_of_range"),
    ],
)
def test_non_finite_numbers_are_refused(world: World, literal: str, param: str, code: str) -> None:
    # A field the server accepts and ignores: the decoder itself must refuse the number.
    body = chat_body(response_format={"type": "text", "strict": "@"})
    text_body = json.dumps(body).replace('"@"', literal)
    assert_400(raw(world, "POST", CHAT, text_body, world.member), param, code)
    assert raw(world, "POST", CHAT, text_body.replace(literal, "-0"), world.member).status_code == 200


def test_structure_limits_are_400s_naming_the_path(world: World) -> None:
    deep = '{"model": "m", "prompt": "x", "a": ' + "[" * 40 + "]" * 40 + "}"
    assert_400(raw(world, "POST", COMPLETIONS, deep, world.member), "a" + "[0]" * 15, "json_too_deep")
    very_deep = "[" * 200_000 + "]" * 200_000  # past Python's recursion limit
    assert_400(raw(world, "POST", COMPLETIONS, very_deep, world.member), None, "json_too_deep")
    long_text = json.dumps(chat_body("y" * 5000))
    assert_400(raw(world, "POST", CHAT, long_text, world.member), "messages[0].content", "string_too_long")
    long_list = json.dumps({"model": MODEL, "prompt": list(range(65))})
    assert_400(raw(world, "POST", COMPLETIONS, long_list, world.member), "prompt", "array_too_long")
    # The admin API decodes through the same layer.
    admin_deep = '{"name": "g", "spec": {"blocklist": ' + "[" * 20 + "]" * 20 + "}}"
    assert_400(raw(world, "POST", "/admin/v1/guardrails", admin_deep, world.acme_admin),
               "spec.blocklist" + "[0]" * 14, "json_too_deep")


def test_nul_is_refused_where_the_store_keeps_it_but_allowed_in_prompts(world: World) -> None:
    # PostgreSQL's text columns cannot hold U+0000: refused before the store sees it.
    body = {"name": "with\x00nul", "spec": {}}
    version = world.store.policy_version()
    assert_400(world.client.post("/admin/v1/guardrails", json=body, headers=world.acme_admin), "name",
               "invalid_unicode")
    assert world.store.policy_version() == version
    prompt = world.client.post(COMPLETIONS, json={"model": MODEL, "prompt": "a\x00b", "max_tokens": 1},
                               headers=world.member)  # fmt: skip
    assert prompt.status_code == 200, prompt.text


def test_syntax_errors_stay_400_invalid_json(world: World) -> None:
    for body in ('{"model": ', "[1, 2]", "", '{"a": 1} trailing', b"\xff\xfe{}"):
        response = raw(world, "POST", CHAT, body, world.member)
        assert_400(response, None, "invalid_json")


# -- guardrails: validated on write, and a stored one that cannot be used -----------------


def chat_status(world: World, headers: dict[str, str]) -> Any:
    return world.client.post(CHAT, json=chat_body(), headers=headers)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"name": "g", "spec": {"blocklist": [{"id": "w", "literal": "\\ud800"}]}}', "spec.blocklist[0].literal"),
        ('{"name": "g", "spec": {}, "sensitive_spec": {"blocklist": [{"literal": "a\\udc00"}]}}',
         "sensitive_spec.blocklist[0].literal"),
        ('{"name": "g", "spec": {"blocklist": [{"regex": "x\\ud800+"}]}}', "spec.blocklist[0].regex"),
    ],
    ids=["literal", "sensitive-literal", "regex"],
)
def test_a_guardrail_with_a_lone_surrogate_is_refused_and_not_stored(world: World, body: str, param: str) -> None:
    version = world.store.policy_version()
    assert_400(raw(world, "POST", "/admin/v1/guardrails", body, world.acme_admin), param, "invalid_unicode")
    assert world.store.policy_version() == version
    assert world.client.get("/admin/v1/guardrails", headers=world.acme_admin).json()["data"] == []
    assert chat_status(world, world.member).status_code == 200


def test_policy_validation_refuses_what_cannot_be_compiled() -> None:
    """The policy layer's own check (any writer, not only the gateway): the same literal is a 422 naming it."""
    from inferflux.policy.errors import ValidationFailed
    from inferflux.policy.guardrails import validate_policy

    cases = [
        ({"blocklist": [{"id": "w", "literal": "\ud800"}]}, None, "spec.blocklist[0].literal"),
        ({}, json.dumps({"blocklist": [{"literal": "ok\udfff"}]}), "sensitive_spec.blocklist[0].literal"),
        ({}, json.dumps({"opa_token": "\ud800"}), "sensitive_spec.opa_token"),
        ({"opa": {"rego": "package x\n# \ud800"}}, None, "spec.opa.rego"),
    ]
    for spec, sensitive, param in cases:
        with pytest.raises(ValidationFailed) as caught:
            validate_policy(spec, sensitive, name="g")
        assert caught.value.param == param


def test_the_store_refuses_text_it_could_not_give_back(world: World) -> None:
    from inferflux.policy.errors import ValidationFailed

    acme = world.acme.id
    for call in (
        lambda: world.store.create_policy(acme, "guardrail", "g", {"blocklist": [{"literal": "\ud800"}]}),
        lambda: world.store.create_policy(acme, "guardrail", "n\x00ul", {}),
        lambda: world.store.create_policy(acme, "guardrail", "g", {}, sensitive_spec='{"x": "\ud800"}'),
        lambda: world.store.create_tenant("t", display_name="a\udc00"),
    ):
        with pytest.raises(ValidationFailed):
            call()


def _corrupt(world: World, policy_id: str, spec: str) -> None:
    """Write ``spec`` (JSON text) into the row as an older version might have, past every check."""
    with world.store.engine.begin() as connection:
        connection.execute(text("UPDATE policies SET spec = :spec WHERE id = :id"), {"spec": spec, "id": policy_id})
    world.app.state.guardrails.invalidate()  # as a replica would at its next poll


@pytest.mark.parametrize("where", ["spec", "sensitive_spec"])
def test_a_stored_policy_that_cannot_be_used_is_a_503_and_stays_manageable(world: World, where: str) -> None:
    client, acme = world.client, world.acme
    made = client.post("/admin/v1/guardrails", json={"name": "legacy", "spec": {"blocklist": [{"literal": "zz"}]}},
                       headers=world.acme_admin)  # fmt: skip
    assert made.status_code == 201, made.text
    policy_id = made.json()["id"]
    if where == "spec":
        _corrupt(world, policy_id, '{"blocklist": [{"id": "w", "literal": "\\ud800"}]}')
    else:  # through the repository: the sensitive spec is sealed, so no SQL can write it
        world.store.update_policy(acme.id, policy_id, sensitive_spec='{"blocklist": [{"literal": "\\ud800"}]}')
        world.app.state.guardrails.invalidate()

    refused = chat_status(world, world.member)
    assert refused.status_code == 503, refused.text
    error = error_of(refused)
    assert error["code"] == "policy_unusable" and policy_id in error["message"], error
    completion = client.post(COMPLETIONS, json={"model": MODEL, "prompt": "x", "max_tokens": 1}, headers=world.member)
    assert completion.status_code == 503 and error_of(completion)["code"] == "policy_unusable"
    assert chat_status(world, world.other_member).status_code == 200  # another tenant is not affected

    one = f"/admin/v1/guardrails/{policy_id}"
    for headers, params in ((world.acme_admin, {}), (world.admin, {"tenant_id": acme.id})):
        listed = client.get("/admin/v1/guardrails", params=params, headers=headers)
        assert listed.status_code == 200 and [p["id"] for p in listed.json()["data"]] == [policy_id], listed.text
        read = client.get(one, params=params, headers=headers)
        assert read.status_code == 200 and read.json()["id"] == policy_id, read.text
    assert client.delete(one, headers=world.acme_admin).status_code == 204
    assert chat_status(world, world.member).status_code == 200


async def _refresh_limits(world: World) -> None:
    await world.app.state.limiter.limits.refresh(force=True)  # as a replica would at its next poll


def test_a_stored_limit_that_cannot_be_used_fails_closed_and_stays_manageable(world: World) -> None:
    client, acme = world.client, world.acme
    made = client.post(f"/admin/v1/tenants/{acme.id}/policies", headers=world.admin,
                       json={"kind": "rate_limit", "name": "legacy", "spec": {"requests_per_minute": 10**6}})  # fmt: skip
    assert made.status_code == 201, made.text
    policy_id = made.json()["id"]
    with world.store.engine.begin() as connection:
        connection.execute(text("UPDATE policies SET spec = :spec WHERE id = :id"),
                           {"spec": '{"requests_per_minute": -3}', "id": policy_id})  # fmt: skip
    world.client.portal.call(_refresh_limits, world)

    refused = chat_status(world, world.member)
    assert refused.status_code == 503, refused.text  # not served without the limit it was meant to set
    error = error_of(refused)
    assert error["code"] == "policy_unusable" and policy_id in error["message"], error
    assert chat_status(world, world.other_member).status_code == 200  # another tenant is not affected

    one = f"/admin/v1/tenants/{acme.id}/policies/{policy_id}"
    for headers in (world.acme_admin, world.admin):
        assert client.get(one, headers=headers).status_code == 200
    assert client.delete(one, headers=world.admin).status_code == 204
    world.client.portal.call(_refresh_limits, world)
    assert chat_status(world, world.member).status_code == 200


# -- stop sequences -------------------------------------------------------------------------------


def test_stop_sequences_are_bounded_in_number_and_bytes(world: World) -> None:
    ok = chat_body(stop=[f"s{i}" for i in range(15)] + ["é" * 256])  # 16 of them; the last is 512 bytes
    assert world.client.post(CHAT, json=ok, headers=world.member).status_code == 200
    too_many = chat_body(stop=[f"s{i}" for i in range(17)])
    assert_400(world.client.post(CHAT, json=too_many, headers=world.member), "stop")
    too_long = {"model": MODEL, "prompt": "x", "max_tokens": 1, "stop": ["a", "é" * 256 + "x"]}
    assert_400(world.client.post(COMPLETIONS, json=too_long, headers=world.member), "stop[1]")
    one_string = {"model": MODEL, "prompt": "x", "max_tokens": 1, "stop": "y" * 513}
    assert_400(world.client.post(COMPLETIONS, json=one_string, headers=world.member), "stop")
