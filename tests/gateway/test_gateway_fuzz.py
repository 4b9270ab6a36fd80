"""Fuzzing the whole API (issue 18): no input, from any role, gets a 5xx.

Two generators against a live loopback server (real sockets, real store and
model, real audit spool):

* schemathesis over the served ``/openapi.json``: every tenant and admin
  operation, valid and invalid inputs (``mode: all``), each case sent as one of
  the four roles (platform-admin, tenant-admin, member, viewer), drawn with it;
* hypothesis bodies for every operation that reads one: objects of its own
  field names (and others) holding hostile values — lone surrogates, NUL, bidi
  overrides, very long strings, integers of thousands of digits, ``1e400``,
  ``-0``, ``NaN`` and ``Infinity`` — sent as raw JSON text, and generation
  requests for the real model with hostile prompts and stop sequences;
* hostile messages on one ``/v1/websocket`` connection (issue 48): hostile JSON,
  envelopes of hostile ids, types and bodies, and the generation requests above in
  a valid envelope; every error event's status must be below 500 and the
  connection must take a request after them all;
* hostile schemas (issue 44) in ``response_format``, in ``tools`` (with every
  ``tool_choice``) and as ``guided_regex``: deep nesting, huge enums, many
  patterns (in one ``allOf`` and spread out), recursive ``$ref``, huge
  ``minLength``/``maxLength`` and other bounds, hard and long regexes. Each must
  also end within its grammar budget (``GRAMMAR``: its wait for a worker and its
  wall time, with a margin for the rest of the request).

Every answer must be below 500, and the run counts its cases (at least
``MIN_CASES``). Generation requests ask for at most a few tokens, and
schemathesis's model names are random (404), so the model does little work.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from websockets.sync.client import connect as ws_connect
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from admin_seed import seed_store
from http_helpers import bearer
from servers import start_uvicorn, stop_uvicorn

MODEL = "smollm2-135m-instruct"
ROLES = ("platform-admin", "tenant-admin", "member", "viewer")
# $INFERFLUX_FUZZ_SCALE (default 1) multiplies the examples: 0.05 for a quick look, 10 for a long hunt.
SCALE = float(os.environ.get("INFERFLUX_FUZZ_SCALE", "1"))
SCHEMA_EXAMPLES = max(1, round(40 * SCALE))  # per operation; 58 operations
BODY_EXAMPLES = max(1, round(3400 * SCALE))  # hostile bodies over every operation that reads one (also the margin over MIN_CASES)
GENERATION_EXAMPLES = max(1, round(200 * SCALE))  # hostile generation requests (the model runs)
SCHEMA_BODY_EXAMPLES = max(1, round(100 * SCALE))  # hostile schemas and tool lists (grammar workers run)
WEBSOCKET_EXAMPLES = max(1, round(200 * SCALE))  # hostile messages on one /v1/websocket connection
MIN_CASES = round(5000 * min(SCALE, 1))
# The fuzzed app's grammar budget (for each request's new grammars), and the longest a hostile-schema request
# may take: a wait for a worker, the budget's wall time, and a margin for starting a worker, loading its
# vocabulary (about a second) and the rest of the request on a loaded machine.
GRAMMAR = {"cpu_seconds": 0.5, "wall_seconds": 3.0, "queue_seconds": 10.0}
SCHEMA_CASE_SECONDS = GRAMMAR["queue_seconds"] + GRAMMAR["wall_seconds"] + 15.0


@dataclass
class Fuzz:
    url: str
    headers: dict[str, dict[str, str]]  # role -> credentials
    acme: str  # the tenant of the tenant roles
    victim_tenant: str  # the one platform-admin cases may change
    victim_key: str  # a key of acme that cases may revoke
    victim_credential: str  # a platform credential that cases may rotate or delete
    cases: int = 0
    failures: list[str] = field(default_factory=list)
    runs: int = 0  # fuzzing tests that ran to the end


@pytest.fixture(scope="module")
def fuzz(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzz]:
    data_dir: Path = tmp_path_factory.mktemp("fuzz")
    seeded = seed_store(data_dir)
    store, acme = seeded.store, seeded.acme
    _, member = store.create_api_key(acme.id, "fuzz-member", "member")
    _, viewer = store.create_api_key(acme.id, "fuzz-viewer", "viewer")
    victim_key, _ = store.create_api_key(acme.id, "victim", "member")
    victim = store.create_tenant("victim")
    victim_credential = store.create_credential(None, "victim", "sk-victim")
    app = make_app(store, data_dir=str(data_dir / "app"), grammar=GRAMMAR)
    server, thread, sock, url = start_uvicorn(app)
    headers = {"platform-admin": seeded.admin, "tenant-admin": seeded.acme_admin, "member": bearer(member),
               "viewer": bearer(viewer)}  # fmt: skip
    state = Fuzz(url, headers, acme.id, victim.id, victim_key.id, victim_credential.id)
    try:
        yield state
    finally:
        stop_uvicorn(server, thread, sock)
        store.close()
    print(f"\nfuzz: {state.cases} cases, {len(state.failures)} answered 5xx")  # in the log with -s / -rP
    assert not state.failures, "\n".join(state.failures[:20])
    if state.runs == len(_operation_ids()) + 4:  # the whole module ran (not a -k selection)
        assert state.cases >= MIN_CASES, f"only {state.cases} fuzz cases ran (at least {MIN_CASES} expected)"


@pytest.fixture(scope="module")
def api_schema(fuzz: Fuzz) -> Any:
    document = httpx.get(f"{fuzz.url}/openapi.json", headers=fuzz.headers["viewer"], timeout=30).json()
    config = schemathesis.Config.from_dict({
        "base-url": fuzz.url,
        "generation": {"mode": "all", "max-examples": SCHEMA_EXAMPLES, "deterministic": True, "database": "none"},
    })  # fmt: skip
    return schemathesis.openapi.from_dict(document, config=config)


def record(fuzz: Fuzz, what: str, response: Any) -> None:
    fuzz.cases += 1
    if response.status_code >= 500:
        fuzz.failures.append(f"{what} -> {response.status_code}: {response.text[:300]}")


# -- the document describes every body ----------------------------------------------


def test_every_write_operation_documents_its_body(fuzz: Fuzz) -> None:
    document = httpx.get(f"{fuzz.url}/openapi.json", headers=fuzz.headers["viewer"], timeout=30).json()
    writes = [(path, method) for path, ops in document["paths"].items() for method in ops
              if method in ("post", "put", "patch")]  # fmt: skip
    assert len(writes) > 15
    missing = [(path, method) for path, method in writes if "requestBody" not in document["paths"][path][method]]
    assert missing == []


# -- schemathesis ----------------------------------------------------------------------
# Through its Python API (each operation's case strategy) rather than its pytest plugin,
# which does not run under this pytest.


def _operation_ids() -> list[str]:
    """Every operation the app serves, as "METHOD /path" (a test checks the served document has the same)."""
    from inferflux.gateway.openapi import openapi_path
    from inferflux.gateway.routes import admin, health, openai

    routes = [*openai.routes(), *admin.routes(), *health.routes()]
    ids = {f"{method} {openapi_path(route.path)}" for route in routes for method in route.methods - {"HEAD"}}
    return sorted(ids | {"GET /metrics", "GET /openapi.json"})


def test_the_fuzzed_operations_are_the_served_ones(api_schema: Any) -> None:
    served = {f"{r.ok().method.upper()} {r.ok().path}" for r in api_schema.get_all_operations()}
    assert served == set(_operation_ids())


def bound_tail(case: Any) -> None:
    """The audit tail streams until ``max_seconds``: a number the fuzzer chose becomes 0.1 (others stay, to be refused)."""
    if not case.path.endswith("/audit/stream"):
        return
    query = dict(case.query or {})
    try:
        float(query.get("max_seconds", "0"))
    except (TypeError, ValueError):
        return
    query["max_seconds"] = "0.1"
    case.query = query


@pytest.mark.parametrize("operation_id", _operation_ids())
def test_schemathesis_finds_no_5xx(fuzz: Fuzz, api_schema: Any, operation_id: str) -> None:
    method, path = operation_id.split(" ", 1)
    operation = next(r.ok() for r in api_schema.get_all_operations()
                     if r.ok().method.upper() == method and r.ok().path == path)  # fmt: skip
    cases = st.one_of(operation.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE))

    @given(case=cases, role=st.sampled_from(ROLES))
    @settings(max_examples=SCHEMA_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)  # fmt: skip
    def run(case: Any, role: str) -> None:
        bound_tail(case)
        response = case.call(headers=fuzz.headers[role], timeout=60)
        record(fuzz, f"{role} {case.method} {case.formatted_path} {case.body!r:.200}", response)

    run()
    fuzz.runs += 1


# -- hostile JSON bodies -------------------------------------------------------------------

HOSTILE_TEXT = st.one_of(
    st.text(st.characters(codec=None, categories=("Cs", "Cc", "Cf", "Co", "Zs", "L", "N")), max_size=40),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "nul\x00in", "\u202eevil\u202c", "\ufeff", "\u200b" * 5,
                     "ｓｋｉ", "%s%n", "../../etc/passwd", "' OR 1=1 --"]),
    st.integers(1, 5).map(lambda k: "é" * (20_000 * k)),  # long strings (the default limit is 1 Mi characters)
)
# Numbers as JSON text: json.dumps cannot write every one of these.
HOSTILE_NUMBER = st.one_of(
    st.integers().map(str),
    st.integers(20, 6000).map(lambda digits: "9" * digits),
    st.integers(20, 6000).map(lambda digits: "-" + "1" * digits),
    st.sampled_from(["-0", "0.0", "-0.0", "1e400", "-1e400", "1e-400", "NaN", "Infinity", "-Infinity",
                     "1.7976931348623157e308", "4.9e-324", "123456789012345678901234567890"]),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
)


def _json_text(value: Any) -> str:
    """JSON text of ``value`` whose ``str`` values starting with the marker are spliced in raw (numbers)."""
    if isinstance(value, _Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_json_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_json_text(v) for v in value) + "]"
    return json.dumps(value)  # ensure_ascii: a lone surrogate goes out as \ud800


@dataclass(frozen=True)
class _Raw:
    text: str


def hostile_values() -> st.SearchStrategy[Any]:
    leaves = st.one_of(HOSTILE_TEXT, HOSTILE_NUMBER.map(_Raw), st.booleans(), st.none())
    return st.recursive(
        leaves,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(HOSTILE_TEXT, inner, max_size=4)),
        max_leaves=12,
    )


def write_operations(document: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    """(method, path, its body's field names) of every operation with a body."""
    schemas = document["components"]["schemas"]
    out = []
    for path, ops in document["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody")
            if body is None:
                continue
            ref = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
            out.append((method.upper(), path, sorted(schemas[ref].get("properties", {}))))
    return out


def fill_path(path: str, fuzz: Fuzz, role: str) -> str:
    tenant = fuzz.victim_tenant if role == "platform-admin" else fuzz.acme
    return (path.replace("{tenant_id}", tenant).replace("{key_id}", fuzz.victim_key)
            .replace("{credential_id}", fuzz.victim_credential)
            .replace("{model_id}", MODEL).replace("{name}", "no-such-model"))  # fmt: skip


@pytest.fixture(scope="module")
def operations(fuzz: Fuzz) -> list[tuple[str, str, list[str]]]:
    document = httpx.get(f"{fuzz.url}/openapi.json", headers=fuzz.headers["viewer"], timeout=30).json()
    return [op for op in write_operations(document) if "/models" not in op[1] or op[1].startswith("/v1/")]


@pytest.fixture(scope="module")
def client(fuzz: Fuzz) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz.url, timeout=60) as http:
        yield http


def test_hostile_bodies_find_no_5xx(fuzz: Fuzz, operations: list[Any], client: httpx.Client) -> None:
    @given(data=st.data(), role=st.sampled_from(ROLES))
    @settings(max_examples=BODY_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def run(data: st.DataObject, role: str) -> None:
        method, path, fields = data.draw(st.sampled_from(operations))
        keys = st.one_of(st.sampled_from(fields or ["x"]), HOSTILE_TEXT)
        body = data.draw(st.dictionaries(keys, hostile_values(), max_size=6))
        text = _json_text(body)
        response = client.request(method, fill_path(path, fuzz, role), content=text.encode("utf-8", "surrogatepass"),
                                  headers={**fuzz.headers[role], "content-type": "application/json"})  # fmt: skip
        record(fuzz, f"{role} {method} {path} {text[:200]!r}", response)

    run()
    fuzz.runs += 1


def structured_fields() -> dict[str, st.SearchStrategy[Any]]:
    """Structured outputs and logit_bias: near-valid shapes (a real schema of hostile values, token ids
    of any size) as well as hostile ones."""
    schema = st.one_of(hostile_values(), st.dictionaries(st.sampled_from(["type", "properties", "items", "enum",
                                                                           "required", "pattern", "$ref"]),
                                                         hostile_values(), max_size=4))  # fmt: skip
    response_format = st.one_of(
        hostile_values(),
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])},
                              optional={"json_schema": st.fixed_dictionaries(
                                  {"name": st.one_of(st.just("x"), HOSTILE_TEXT)},
                                  optional={"schema": schema, "strict": st.booleans()})}),
    )  # fmt: skip
    token = st.one_of(st.integers(-5, 60_000).map(str), HOSTILE_TEXT)
    logit_bias = st.one_of(hostile_values(), st.dictionaries(token, HOSTILE_NUMBER.map(_Raw), max_size=5))
    return {"response_format": response_format, "logit_bias": logit_bias, "guided_regex": HOSTILE_TEXT,
            "guided_choice": st.one_of(st.lists(HOSTILE_TEXT, max_size=3), hostile_values())}


def tool_fields() -> dict[str, st.SearchStrategy[Any]]:
    """Tool calling: near-valid tools (names, schemas of hostile values), choices and history, and hostile ones."""
    name = st.one_of(st.sampled_from(["f", "get_weather", "x" * 65, "bad name"]), HOSTILE_TEXT)
    function = st.fixed_dictionaries({"name": name}, optional={
        "description": HOSTILE_TEXT, "parameters": st.one_of(hostile_values(), st.dictionaries(
            st.sampled_from(["type", "properties", "required", "enum", "$defs", "$ref"]), hostile_values(), max_size=3))})
    tool = st.one_of(hostile_values(), st.fixed_dictionaries({"type": st.just("function"), "function": function}))
    choice = st.one_of(st.sampled_from(["none", "auto", "required"]), hostile_values(),
                       st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": name})}))
    call = st.fixed_dictionaries({"id": st.one_of(st.just("call_1"), HOSTILE_TEXT), "type": st.just("function"),
                                  "function": st.fixed_dictionaries({"name": name, "arguments": st.one_of(
                                      st.just("{}"), HOSTILE_TEXT, hostile_values())})})
    history = st.lists(st.one_of(
        st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(), "tool_calls": st.lists(call, max_size=2)}),
        st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.one_of(st.just("call_1"), HOSTILE_TEXT),
                               "content": HOSTILE_TEXT})), min_size=1, max_size=3)
    return {"tools": st.one_of(hostile_values(), st.lists(tool, max_size=3)), "tool_choice": choice,
            "parallel_tool_calls": st.one_of(st.booleans(), hostile_values()), "messages": history.map(
                lambda h: [{"role": "user", "content": "hi"}, *h])}  # fmt: skip


def generation_bodies() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """Requests for the real model (a few tokens at most, or embeddings of a few inputs) with hostile
    prompts, inputs, stops and extras."""
    text = HOSTILE_TEXT
    chat = st.fixed_dictionaries(
        {"model": st.just(MODEL), "max_tokens": st.integers(1, 3),
         "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                     "content": text}), min_size=1, max_size=3)},
        optional={"stop": st.one_of(text, st.lists(text, max_size=20)), "n": st.integers(1, 2),
                  "stream": st.booleans(), "seed": HOSTILE_NUMBER.map(_Raw), "temperature": HOSTILE_NUMBER.map(_Raw),
                  "user": text, **structured_fields()},
    )  # fmt: skip
    # The chat body again, with tools: their fields and a history of calls and results in place of the messages.
    tool_chat = st.tuples(chat, st.fixed_dictionaries({}, optional=tool_fields())).map(lambda p: {**p[0], **p[1]})
    completion = st.fixed_dictionaries(
        {"model": st.just(MODEL), "max_tokens": st.integers(1, 3),
         "prompt": st.one_of(text, st.lists(text, min_size=1, max_size=3), st.lists(HOSTILE_NUMBER.map(_Raw),
                                                                                   min_size=1, max_size=5))},
        optional={"stop": st.one_of(text, st.lists(text, max_size=20)), "echo": st.booleans(),
                  "logprobs": HOSTILE_NUMBER.map(_Raw), "stream": st.booleans(), "n": st.integers(1, 2),
                  "best_of": st.one_of(st.integers(1, 4).map(str), HOSTILE_NUMBER).map(_Raw), "suffix": text, "user": text,
                  **structured_fields()},
    )  # fmt: skip
    ids = st.lists(HOSTILE_NUMBER.map(_Raw), min_size=1, max_size=5)
    embeddings = st.fixed_dictionaries(
        {"model": st.just(MODEL),
         "input": st.one_of(text, st.lists(text, min_size=1, max_size=4), ids, st.lists(ids, max_size=3))},
        optional={"encoding_format": st.one_of(st.sampled_from(["float", "base64"]), text),
                  "dimensions": HOSTILE_NUMBER.map(_Raw), "user": text},
    )  # fmt: skip
    return st.one_of(chat.map(lambda b: ("/v1/chat/completions", b)),
                     tool_chat.map(lambda b: ("/v1/chat/completions", b)), completion.map(lambda b: ("/v1/completions", b)),
                     embeddings.map(lambda b: ("/v1/embeddings", b)), *adapter_bodies())  # fmt: skip


def adapter_bodies() -> list[st.SearchStrategy[tuple[str, dict[str, Any]]]]:
    """/v1/responses, /v1/messages and its count_tokens for the real model: their vendors' shapes, near-valid and hostile."""
    text = HOSTILE_TEXT
    part = st.one_of(hostile_values(), st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text",
                                                                                       "input_image", "refusal"]),
                                                              "text": text}))  # fmt: skip
    item = st.one_of(
        hostile_values(),
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]),
                               "content": st.one_of(text, st.lists(part, max_size=3))}),
        st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text, "name": text, "arguments": text}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text, "output": text}),
    )  # fmt: skip
    response = st.fixed_dictionaries(
        {"model": st.just(MODEL), "max_output_tokens": st.integers(1, 3),
         "input": st.one_of(text, st.lists(item, min_size=1, max_size=4))},
        optional={"instructions": text, "stream": st.booleans(), "temperature": HOSTILE_NUMBER.map(_Raw),
                  "store": hostile_values(), "previous_response_id": text, "text": hostile_values(),
                  "tools": hostile_values(), "tool_choice": hostile_values(), "metadata": hostile_values()},
    )  # fmt: skip
    block = st.one_of(
        hostile_values(),
        st.fixed_dictionaries({"type": st.just("text"), "text": text}),
        st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": text, "input": hostile_values()}),
        st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": text,
                               "content": st.one_of(text, hostile_values())}),
    )  # fmt: skip
    message = st.fixed_dictionaries(
        {"model": st.just(MODEL), "max_tokens": st.integers(1, 3),
         "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                                     "content": st.one_of(text, st.lists(block, max_size=3))}),
                              min_size=1, max_size=3)},
        optional={"system": st.one_of(text, st.lists(block, max_size=2)), "stream": st.booleans(),
                  "stop_sequences": st.lists(text, max_size=20), "top_k": HOSTILE_NUMBER.map(_Raw),
                  "tools": hostile_values(), "tool_choice": hostile_values(), "metadata": hostile_values()},
    )  # fmt: skip
    # Anthropic's token count takes the Messages body (its max_tokens checked and ignored).
    return [response.map(lambda b: ("/v1/responses", b)), message.map(lambda b: ("/v1/messages", b)),
            message.map(lambda b: ("/v1/messages/count_tokens", b))]


def test_hostile_generation_requests_find_no_5xx(fuzz: Fuzz, client: httpx.Client) -> None:
    @given(request=generation_bodies(), role=st.sampled_from(("platform-admin", "tenant-admin", "member")))
    @settings(max_examples=GENERATION_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True)  # fmt: skip
    def run(request: tuple[str, dict[str, Any]], role: str) -> None:
        path, body = request
        text = _json_text(body)
        response = client.post(path, content=text.encode("utf-8", "surrogatepass"),
                               headers={**fuzz.headers[role], "content-type": "application/json"})  # fmt: skip
        record(fuzz, f"{role} POST {path} {text[:200]!r}", response)

    run()
    fuzz.runs += 1


# -- the WebSocket front door ------------------------------------------------------------------

WS_TYPES = st.one_of(st.sampled_from(["chat.completions", "completions", "cancel"]), HOSTILE_TEXT, hostile_values())


def websocket_messages() -> st.SearchStrategy[str]:
    """Hostile JSON, envelopes of hostile ids, types and bodies, and generation requests in a valid envelope."""
    generation = generation_bodies().filter(lambda r: r[0] in ("/v1/chat/completions", "/v1/completions")).map(
        lambda r: {"id": "g", "type": r[0].removeprefix("/v1/").replace("chat/", "chat."), "body": r[1]})
    envelope = st.fixed_dictionaries({}, optional={"id": st.one_of(HOSTILE_TEXT, hostile_values()), "type": WS_TYPES,
                                                   "body": hostile_values()})  # fmt: skip
    return st.one_of(HOSTILE_TEXT, hostile_values().map(_json_text), envelope.map(_json_text),
                     generation.map(_json_text))  # fmt: skip


def _ws_answer(ws: Any, what: str, fuzz: Fuzz) -> None:
    """The events of one message, up to its end; an error event of status 500 or more is a failure."""
    fuzz.cases += 1
    while True:
        event = json.loads(ws.recv(timeout=60))
        if event.get("type") == "error" and not 400 <= event.get("status", 0) < 500:
            fuzz.failures.append(f"websocket {what} -> {event.get('status')}: {json.dumps(event)[:300]}")
        if event.get("type") in ("done", "error", "cancelled"):
            return


def test_hostile_websocket_messages_find_no_5xx(fuzz: Fuzz) -> None:
    url = fuzz.url.replace("http://", "ws://") + "/v1/websocket"
    with ws_connect(url, additional_headers=fuzz.headers["member"], open_timeout=30) as ws:

        @given(message=websocket_messages())
        @settings(max_examples=WEBSOCKET_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True)  # fmt: skip
        def run(message: str) -> None:
            data = message.encode("utf-8", "surrogatepass")
            ws.send(data if len(data) % 2 else message if message.isprintable() and data.isascii() else data)
            _ws_answer(ws, repr(message[:200]), fuzz)

        run()
        ws.send(json.dumps({"id": "after", "type": "completions", "body": {"model": MODEL, "prompt": "Hi", "max_tokens": 2}}))
        last = json.loads(ws.recv(timeout=60))
        while last["type"] == "chunk":
            last = json.loads(ws.recv(timeout=60))
        assert last["id"] == "after" and last["type"] == "done", "the connection no longer takes requests"
    fuzz.runs += 1


# -- hostile schemas and tool lists ----------------------------------------------------------

BOUND_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
HARD_REGEXES = ("^(a|b)*a(a|b){30}$", "(a{1,100}){1,100}", "^((a|b){1,50}c){1,50}$", "(a*)*b", "(?=a)a", "\\",
                "[", "x{1000}{1000}", "(.*){1,64}", "[\\s\\S]{0,100000}")  # fmt: skip


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"p{i}": schema}, "required": [f"p{i}"]}
    return schema


def _bounded(keyword: str, value: Any) -> dict[str, Any]:
    kind = "array" if "Items" in keyword else "object" if "Properties" in keyword else "string"
    return {"type": "object", "properties": {"v": {"type": kind, keyword: value}}, "required": ["v"]}


def hostile_schemas() -> st.SearchStrategy[Any]:
    """Schemas shaped to cost the guardrails or the grammar engine; ``tag`` makes each its own grammar, since
    the grammar workers remember their verdicts."""
    tag = st.integers(0, 10**6)
    deep = st.integers(1, 40).map(_nested)
    enum = st.tuples(st.integers(1, 6000), tag).map(
        lambda p: {"type": "object", "properties": {"v": {"enum": [f"v{p[1]}-{i}" for i in range(p[0])]}}})
    all_of = st.tuples(st.integers(1, 400), tag).map(lambda p: {"type": "object", "required": ["s"], "properties": {
        "s": {"type": "string", "allOf": [{"pattern": f"t{p[1]}x{i}"} for i in range(p[0])]}}})
    spread = st.tuples(st.integers(1, 300), tag).map(lambda p: {"type": "object", "properties": {
        f"k{i}": {"type": "string", "pattern": f"^{p[1]}[a-z]{{{i}}}$"} for i in range(p[0])}})
    recursive = st.sampled_from([
        {"$ref": "#"},
        {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}},
        {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}}, "$ref": "#/$defs/n"},
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
        {"$ref": "http://169.254.169.254/latest/meta-data"},
    ])
    bounds = st.tuples(st.sampled_from(BOUND_KEYWORDS),
                       st.sampled_from([0, 1, 1000, 100_000, 100_001, 10**9, 10**18, -1, 2.5, 1e300])).map(
        lambda p: _bounded(*p))
    regex = st.one_of(st.sampled_from(HARD_REGEXES), st.integers(100, 10_000).map(lambda n: "a" * n))
    patterned = regex.map(lambda r: {"type": "object", "properties": {"v": {"type": "string", "pattern": r}}})
    return st.one_of(deep, enum, all_of, spread, recursive, bounds, patterned)  # fmt: skip


def hostile_schema_bodies() -> st.SearchStrategy[dict[str, Any]]:
    """Chat bodies carrying hostile schemas: as the response format, as tools' parameters (one to three tools,
    or more than the limit allows) with each tool_choice, or a hard regex as guided_regex."""
    schemas = hostile_schemas()
    tools = st.lists(schemas, min_size=1, max_size=3).map(
        lambda ss: [{"type": "function", "function": {"name": f"f{i}", "parameters": s}} for i, s in enumerate(ss)])
    too_many = st.integers(129, 300).map(
        lambda n: [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)])
    choice = st.sampled_from([None, "none", "auto", "required", {"type": "function", "function": {"name": "f0"}}])
    with_tools = st.tuples(st.one_of(tools, too_many), choice).map(
        lambda p: {"tools": p[0], **({} if p[1] is None else {"tool_choice": p[1]})})
    with_format = schemas.map(lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                                 "schema": s}}})
    with_regex = st.one_of(st.sampled_from(HARD_REGEXES), st.integers(1000, 10_000).map(lambda n: "(a|b)" * n)).map(
        lambda r: {"guided_regex": r})
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    return st.one_of(with_tools, with_format, with_regex).map(lambda extra: {**base, **extra})  # fmt: skip


def test_hostile_schemas_find_no_5xx_and_end_within_their_budget(fuzz: Fuzz, client: httpx.Client) -> None:
    @given(body=hostile_schema_bodies(), role=st.sampled_from(("tenant-admin", "member")))
    @settings(max_examples=SCHEMA_BODY_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True)  # fmt: skip
    def run(body: dict[str, Any], role: str) -> None:
        text = json.dumps(body)
        start = time.monotonic()
        response = client.post("/v1/chat/completions", content=text.encode(), timeout=SCHEMA_CASE_SECONDS * 2,
                               headers={**fuzz.headers[role], "content-type": "application/json"})  # fmt: skip
        took = time.monotonic() - start
        record(fuzz, f"{role} POST /v1/chat/completions {text[:200]!r}", response)
        if took > SCHEMA_CASE_SECONDS:
            fuzz.failures.append(f"{took:.1f} s, over the grammar budget's bound: {text[:200]!r} -> {response.text[:200]}")

    run()
    fuzz.runs += 1


def test_the_numbers_are_what_they_claim() -> None:
    """The raw-number splicing really writes what a hostile client would (a check on the fuzzer)."""
    assert _json_text({"a": _Raw("NaN"), "b": [_Raw("1e400")], "c": "\ud800"}) == '{"a":NaN,"b":[1e400],"c":"\\ud800"}'
    assert math.isinf(json.loads("1e400"))
