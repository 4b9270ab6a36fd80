"""Input guardrails over everything that reaches the model, over a real socket (issue 44, items 2-4).

* A lone surrogate inside a history call's ``arguments`` (JSON text inside a JSON string, so the
  body's own decoder lets it through) is a 400 ``invalid_unicode`` naming the arguments, for a
  tenant with guardrails and one without, on the chat and the Responses routes, and the
  keep-alive connection stays up (it was a 500 from the guardrail code or the tokenizer, and a
  dropped connection).
* Every way around the guardrails that the tool surface offered is refused: a blocked word as a
  tool name, a property name, a ``required`` entry, a ``pattern``, a ``$defs`` key, a key of an
  earlier call's arguments; split across a tool result's content parts, or between a call's
  arguments and its result; spelled with joiners (``blue-bird``, ``b_l_u_e_b_i_r_d``); a card
  number written as a JSON number. A redacting rule that matches a name refuses (a name cannot
  be rewritten), and one that matches a value redacts it. Refusals are audited with their findings.
* Token-id inputs (embeddings, completions) are decoded and checked; where they cannot be
  decoded, a tenant with input guardrails gets a 400 ``token_ids_unchecked``.
* A large body is scanned off the event loop: trivial requests on another connection are
  answered, one after another, while the scan runs (asserted on order, not on time).
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from http_helpers import bearer, error_of
from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from test_gateway_adapters import POLL, World, world  # noqa: F401 (world: the live server of a module, as there)

MODEL = DEFAULT_MODEL_NAME
CARD = 4111111111111111  # Luhn-valid
BLOCK = {"blocklist": [{"id": "bird", "literal": "bluebird"}], "pii": {"card": "block"}}
REDACT = {"blocklist": [{"id": "bird", "literal": "bluebird", "action": "redact"}], "pii": {"card": "redact"}}


def _key(world: World, spec: dict[str, Any] | None = None) -> str:
    """A member key of a fresh tenant, with ``spec`` as its guardrail (seen by the server before this returns)."""
    tenant, key = world.tenant_key()
    if spec is not None:
        world.store.create_policy(tenant.id, "guardrail", "g", spec)
        time.sleep(3 * POLL)
    return key


@pytest.fixture(scope="module")
def client(world: World) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=world.url, timeout=120) as c:
        yield c


def _tool(name: str = "lookup", parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    parameters = parameters or {"type": "object", "properties": {"q": {"type": "string"}}}
    return {"type": "function", "function": {"name": name, "description": "Look something up", "parameters": parameters}}


def _history(arguments: str, result: Any) -> list[dict[str, Any]]:
    """A question ending in a letter (so that nothing before the history's texts is a word boundary), a call
    with ``arguments``, and its ``result``."""
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    return [{"role": "user", "content": "Look it up"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": result}]  # fmt: skip


def _schema(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties or {"q": {"type": "string"}}}


def _chat(**body: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Look it up"}], "max_tokens": 1, **body}


def evasions(first: str = "blue", second: str = "bird", card: int = CARD) -> dict[str, dict[str, Any]]:
    """Each way around the guardrails, for the word ``first + second`` (blocked: bluebird; allowed: bluejay)."""
    word = first + second
    return {
        "tool name": _chat(tools=[_tool(name=word)]),
        "property name": _chat(tools=[_tool(parameters=_schema(**{word: {"type": "string"}}))]),
        "required entry": _chat(tools=[_tool(parameters={**_schema(), "required": ["q", word]})]),
        "pattern": _chat(tools=[_tool(parameters=_schema(q={"type": "string", "pattern": f"^{word}$"}))]),
        "$defs key": _chat(tools=[_tool(parameters={**_schema(q={"$ref": f"#/$defs/{word}"}),
                                                    "$defs": {word: {"type": "string"}}})]),
        "key of a call's arguments": _chat(messages=_history(json.dumps({word: "x"}), "ok")),
        "split across a result's parts": _chat(messages=_history('{"q": "x"}', [{"type": "text", "text": first},
                                                                                {"type": "text", "text": second}])),
        "split between a call and its result": _chat(messages=_history(json.dumps({"q": f"the {first}"}),
                                                                       f"{second} sang")),
        "hyphen inside the word": _chat(messages=[{"role": "user", "content": f"a {first}-{second} sang"}]),
        "underscores between its letters": _chat(messages=[{"role": "user", "content": f"a {'_'.join(word)} sang"}]),
        "hyphens between its letters": _chat(messages=[{"role": "user", "content": f"a {'-'.join(word)} sang"}]),
        "card as a JSON number in a call's arguments": _chat(messages=_history(json.dumps({"card": card}), "ok")),
        "card as a JSON number in a tool's enum": _chat(tools=[_tool(parameters=_schema(n={"enum": [card]}))]),
    }  # fmt: skip


EVASIONS = evasions()
CLEAN = evasions(second="jay", card=4111111111111112)  # not a blocked word; not Luhn-valid


@pytest.mark.parametrize("evasion", list(EVASIONS))
def test_every_evasion_through_the_tool_surface_is_refused(world: World, client: httpx.Client,
                                                            evasion: str) -> None:  # fmt: skip
    key = _key(world, BLOCK)
    refused = client.post("/v1/chat/completions", json=EVASIONS[evasion], headers=bearer(key))
    assert refused.status_code == 400, refused.text
    assert error_of(refused)["code"] == "content_filter"
    assert "bluebird" not in refused.text and str(CARD) not in refused.text
    # The same request without the word (or the card number) is served: it is the word that was refused.
    clean = client.post("/v1/chat/completions", json=CLEAN[evasion], headers=bearer(key))
    assert clean.status_code == 200, clean.text


def test_a_refusal_is_audited_with_its_findings(world: World, client: httpx.Client) -> None:
    key = _key(world, BLOCK)
    refused = client.post("/v1/chat/completions", json=EVASIONS["property name"], headers=bearer(key))
    assert refused.status_code == 400
    world.settled()
    event = world.events()[refused.headers["x-request-id"]]
    assert event["decision"] == "deny" and event["status"] == 400
    assert {"type": "blocklist", "rule_id": "blocklist.bird", "stage": "input", "action": "block"} in event["findings"]
    assert any("blocklist.bird" in reason for reason in event["reasons"])


def test_a_redacting_rule_refuses_a_name_and_redacts_a_value(world: World, client: httpx.Client) -> None:
    key = _key(world, REDACT)
    # A tool's name (or a key, a pattern) cannot be rewritten without changing the tool: refused.
    named = client.post("/v1/chat/completions", json=EVASIONS["tool name"], headers=bearer(key))
    assert named.status_code == 400 and error_of(named)["code"] == "content_filter"
    # A value can: the card number in the arguments is redacted, and the request served.
    valued = client.post("/v1/chat/completions", json=EVASIONS["card as a JSON number in a call's arguments"],
                         headers=bearer(key))  # fmt: skip
    assert valued.status_code == 200, valued.text
    world.settled()
    events = world.events()
    assert {"type": "card", "rule_id": "pii.card", "stage": "input", "action": "redact"} in \
        events[valued.headers["x-request-id"]]["findings"]  # fmt: skip
    assert {"type": "blocklist", "rule_id": "blocklist.bird", "stage": "input", "action": "block"} in \
        events[named.headers["x-request-id"]]["findings"]  # fmt: skip


# -- a lone surrogate in a call's arguments ---------------------------------------------------------

SURROGATE_ARGUMENTS = '{"q": "\\ud800"}'  # JSON text whose string is a lone surrogate
ROUTES = {
    "/v1/chat/completions": _chat(messages=_history(SURROGATE_ARGUMENTS, "r")),
    "/v1/responses": {"model": MODEL, "max_output_tokens": 16, "input": [
        {"type": "message", "role": "user", "content": "x"},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": SURROGATE_ARGUMENTS},
        {"type": "function_call_output", "call_id": "call_1", "output": "r"}]},
}  # fmt: skip
# The Responses route names its whole input for any message's error (its items are not the messages one for one).
PARAMS = {"/v1/chat/completions": "messages[1].tool_calls[0].function.arguments", "/v1/responses": "input"}


@pytest.mark.parametrize("guarded", [False, True])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_lone_surrogate_in_a_calls_arguments_is_a_400_and_the_connection_stays(
    world: World, route: str, guarded: bool
) -> None:
    key = _key(world, BLOCK if guarded else None)
    parts = urlsplit(world.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    headers = {**bearer(key), "content-type": "application/json"}
    try:
        conn.request("POST", route, body=json.dumps(ROUTES[route]), headers=headers)
        answer = conn.getresponse()
        body = json.loads(answer.read())
        sock = conn.sock
        assert answer.status == 400, body
        assert body["error"]["code"] == "invalid_unicode" and body["error"]["param"] == PARAMS[route], body
        assert answer.getheader("connection") != "close"
        conn.request("GET", "/livez")
        again = conn.getresponse()
        again.read()
        assert again.status == 200
        assert conn.sock is sock  # the same connection: kept alive after the 400
    finally:
        conn.close()


# -- token ids --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bird_ids(world: World) -> list[int]:
    tokenizer = world.app.state.manager.get(MODEL).local_tokenizer
    return tokenizer.encode("a bluebird sang", add_special_tokens=False)  # type: ignore[no-any-return]


def test_token_id_inputs_are_decoded_and_checked(world: World, client: httpx.Client, bird_ids: list[int]) -> None:
    guarded, free = _key(world, BLOCK), _key(world)
    asks = [("/v1/embeddings", {"model": MODEL, "input": bird_ids}),
            ("/v1/embeddings", {"model": MODEL, "input": [[1, 2], bird_ids]}),
            ("/v1/completions", {"model": MODEL, "prompt": bird_ids, "max_tokens": 1})]  # fmt: skip
    for path, body in asks:
        refused = client.post(path, json=body, headers=bearer(guarded))
        assert refused.status_code == 400 and error_of(refused)["code"] == "content_filter", (path, refused.text)
        passed = client.post(path, json=body, headers=bearer(free))
        if path == "/v1/embeddings":  # past the guardrails; this model takes no token-id inputs (embedding.token_ids)
            assert passed.status_code == 400 and error_of(passed)["code"] == "token_ids_not_enabled", passed.text
        else:
            assert passed.status_code == 200, path


def test_token_ids_that_cannot_be_decoded_are_refused_to_a_guarded_tenant(world: World, client: httpx.Client) -> None:
    # No such model: nothing here can decode the ids, and a guarded tenant's ids are never let through unread.
    body = {"model": "no-such-model", "input": [[1, 2, 3]]}
    refused = client.post("/v1/embeddings", json=body, headers=bearer(_key(world, BLOCK)))
    assert refused.status_code == 400, refused.text
    assert error_of(refused) | {"message": ""} == {"message": "", "type": "invalid_request_error", "param": "input[0]",
                                                   "code": "token_ids_unchecked"}  # fmt: skip
    assert client.post("/v1/embeddings", json=body, headers=bearer(_key(world))).status_code == 404


# -- the scan off the event loop ---------------------------------------------------------------------


def _post_all_but_the_last_byte(url: str, path: str, body: bytes, key: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=120)
    head = (f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    sock.sendall(head + body[:-1])
    return sock


def test_trivial_requests_are_answered_while_a_large_body_is_scanned(world: World) -> None:
    key = _key(world, BLOCK)
    # About 2.4 MB of accented text (slow to reduce to a skeleton), the blocked word at its very end, so that
    # the answer (400) leaves the moment the scan ends.
    body = json.dumps(_chat(messages=[{"role": "user", "content": "é" * 400_000}] * 3 +
                            [{"role": "user", "content": "a bluebird"}]), ensure_ascii=False).encode()  # fmt: skip
    big = _post_all_but_the_last_byte(world.url, "/v1/chat/completions", body, key)
    answered = 0
    with httpx.Client(base_url=world.url, timeout=120) as probe:
        # Probes while the server reads the body: each lets its event loop take in more of it. Not counted.
        for _ in range(50):
            assert probe.get("/livez").status_code == 200
        big.sendall(body[-1:])  # the body is complete: the scan starts
        # One probe at a time, each sent once the previous was answered. Held up by a scan on the event loop,
        # a probe would be answered only after the scan's 400 went out: one or two would be counted.
        while not select.select([big], [], [], 0)[0]:
            assert probe.get("/livez").status_code == 200
            answered += 1
    reply = big.recv(65536).decode("latin-1")
    big.close()
    assert reply.startswith("HTTP/1.1 400") and "content_filter" in reply, reply[:300]
    assert answered >= 5, answered
