"""Hostile schemas and tools over a real socket (issue 44, items 1 and 2): each ends within its budget.

* A string with an ``allOf`` of 420 ``pattern``s (14 KB), in ``response_format`` or in a tool's
  ``parameters``: refused for its size (400 ``schema_too_complex`` naming the field) before any
  guardrail or grammar work. Before the fix, the grammar engine worked on it for minutes, its memory
  growing by gigabytes.
* The same with 24 patterns, under the size limits: llguidance needs more than 30 s and 1.2 GB to
  refuse it. It is built in a grammar worker under the app's budget (1 s of CPU here), killed there,
  and refused with 400 ``schema_too_complex``; the gateway's own memory does not grow, and ``/livez``
  answers while it runs.
* A tool whose parameters hold an enum of 5,000 values, from a tenant whose guardrail blocks one
  of them: refused for its size, not by the guardrail (which, refusing first, would say
  ``content_filter``): the size is decided before the scan.
* A client that leaves while its grammar compiles: the worker is killed at once.

The model is the real SmolLM2 and the grammar library the real llguidance. The grammar workers are the
process's (``shared_sandbox``): each hostile grammar here has letters of its own, since verdicts are
remembered.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from admin_seed import seed_store
from http_helpers import bearer
from processes import alive, cpu_seconds
from servers import start_uvicorn, stop_uvicorn

pytestmark = pytest.mark.slow  # grammar worker processes, stopped over real CPU time

MODEL = "smollm2-135m-instruct"
BLOCKED = "zzqword"  # the tenant's guardrail blocks it
BUDGET = {"cpu_seconds": 1.0, "wall_seconds": 30.0, "queue_seconds": 30.0}
# A client waits this long at most: the budget's wall time, a queue, and a slow machine's margin.
# Before the fix no answer came at all.
PATIENCE = 90.0


@dataclass
class Gateway:
    url: str
    member: dict[str, str]  # a member key of acme, whose guardrail blocks BLOCKED
    admin: dict[str, str]


@contextmanager
def _serve(make_app: Any, data_dir: Path, grammar: dict[str, Any]) -> Iterator[Gateway]:
    seeded = seed_store(data_dir)
    store = seeded.store
    store.create_policy(seeded.acme.id, "guardrail", "words", {"blocklist": [{"id": "w", "literal": BLOCKED}]})
    _, member = store.create_api_key(seeded.acme.id, "app", "member")
    server, thread, sock, url = start_uvicorn(make_app(store, data_dir=str(data_dir / "app"), grammar=grammar))
    try:
        yield Gateway(url, bearer(member), seeded.admin)
    finally:
        stop_uvicorn(server, thread, sock)
        store.close()


@pytest.fixture(scope="module")
def gateway(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with _serve(make_app, tmp_path_factory.mktemp("hostile-schemas"), BUDGET) as served:
        yield served


def patterns(letter: str, count: int) -> dict[str, Any]:
    """An object whose one string must match ``count`` patterns at once."""
    return {"type": "object", "required": ["s"], "properties": {"s": {
        "type": "string", "allOf": [{"pattern": f"{letter}{i:04d}[a-z]+{letter}{i:04d}"} for i in range(count)]}}}  # fmt: skip


def chat(schema: dict[str, Any], where: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    if where == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    else:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    return body


FIELD = {"response_format": "response_format.json_schema.schema", "tools": "tools[0].function.parameters"}


def resident_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * 4096


def post_while_livez(gateway: Gateway, body: dict[str, Any]) -> tuple[httpx.Response, list[float]]:
    """``body`` posted, and ``/livez`` asked again and again while it is in flight: the answer and the
    livez round trips (each must come back before the hostile request's answer)."""
    answer: list[httpx.Response] = []
    failure: list[BaseException] = []

    def hostile() -> None:
        try:
            with httpx.Client(base_url=gateway.url, timeout=PATIENCE) as client:
                answer.append(client.post("/v1/chat/completions", json=body, headers=gateway.member))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            failure.append(exc)

    thread = threading.Thread(target=hostile)
    thread.start()
    livez: list[float] = []
    with httpx.Client(base_url=gateway.url, timeout=PATIENCE) as client:
        while thread.is_alive() and len(livez) < 200:
            start = time.monotonic()
            assert client.get("/livez").status_code == 200
            if thread.is_alive():
                livez.append(time.monotonic() - start)
            time.sleep(0.02)
    thread.join()
    assert not failure, failure
    return answer[0], livez


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_an_allof_of_420_patterns_is_refused_for_its_size(gateway: Gateway, where: str) -> None:
    body = chat(patterns("a" if where == "tools" else "b", 420), where)
    assert 13_000 < len(json.dumps(body)) < 16_000
    with httpx.Client(base_url=gateway.url, timeout=PATIENCE) as client:
        answer = client.post("/v1/chat/completions", json=body, headers=gateway.member)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("schema_too_complex", FIELD[where])
    assert "129 patterns" in error["message"] and "schema_max_patterns" in error["message"]


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_a_grammar_over_its_budget_is_refused_within_it_and_the_gateway_stays_responsive(
    gateway: Gateway, where: str
) -> None:
    from inferflux.backends.engine.grammar_sandbox import shared_sandbox

    over_before = shared_sandbox().snapshot()["over_budget"]
    resident = resident_bytes()
    answer, livez = post_while_livez(gateway, chat(patterns("c" if where == "tools" else "d", 24), where))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("schema_too_complex", FIELD[where]), error
    assert "CPU time" in error["message"] and "grammar.cpu_seconds" in error["message"]
    assert shared_sandbox().snapshot()["over_budget"] == over_before + 1  # stopped by the budget, in a worker
    assert livez, "the hostile request ended before /livez could be asked"
    # The work and its memory were the worker's (1.2 GB before it is refused, unbounded before the fix).
    assert resident_bytes() - resident < 100 << 20
    # Sent again: the verdict is remembered, no worker runs.
    with httpx.Client(base_url=gateway.url, timeout=PATIENCE) as client:
        again = client.post("/v1/chat/completions", json=chat(patterns("c" if where == "tools" else "d", 24), where),
                            headers=gateway.member)  # fmt: skip
    assert again.json()["error"]["code"] == "schema_too_complex"
    assert shared_sandbox().snapshot()["over_budget"] == over_before + 1


def test_an_enum_of_5000_values_is_refused_before_the_guardrail_sees_it(gateway: Gateway) -> None:
    values = [f"value {i}" for i in range(4999)] + [BLOCKED]
    schema = {"type": "object", "properties": {"v": {"enum": values}}}
    with httpx.Client(base_url=gateway.url, timeout=PATIENCE) as client:
        # The guardrail is on: a small enum holding the blocked word is refused by it.
        small = client.post("/v1/chat/completions", json=chat({**schema, "properties": {"v": {"enum": values[-3:]}}},
                                                              "tools"), headers=gateway.member)  # fmt: skip
        assert small.status_code == 400 and small.json()["error"]["code"] == "content_filter", small.text
        answer = client.post("/v1/chat/completions", json=chat(schema, "tools"), headers=gateway.member)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    # Refused for its size, so the guardrail never scanned it (had it, it would have said content_filter).
    assert (error["code"], error["param"]) == ("schema_too_complex", "tools[0].function.parameters")
    assert "5000 enum values" in error["message"]


def test_an_adapter_names_its_own_field(gateway: Gateway) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": patterns("e", 420)}}}  # fmt: skip
    with httpx.Client(base_url=gateway.url, timeout=PATIENCE) as client:
        answer = client.post("/v1/responses", json=body, headers=gateway.member)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("schema_too_complex", "text.format.schema")


def test_a_client_that_leaves_stops_its_compile(make_app: Any, tmp_path: Path) -> None:
    """With a budget of two minutes, the compile runs until the client closes its socket; then its worker is
    killed within a poll interval (before the fix, the compile ran on in the gateway, for minutes)."""
    from inferflux.backends.engine.grammar_sandbox import shared_sandbox

    sandbox = shared_sandbox()
    with _serve(make_app, tmp_path, {"cpu_seconds": 120.0, "wall_seconds": 300.0}) as served:
        cancelled = sandbox.snapshot()["cancelled"]
        url = urlsplit(served.url)
        sock = socket.create_connection((url.hostname, url.port), timeout=60)
        payload = json.dumps(chat(patterns("f", 24), "response_format")).encode()
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                     f"Authorization: {served.member['authorization']}\r\nContent-Length: {len(payload)}\r\n\r\n"
                     .encode() + payload)  # fmt: skip
        pid = _busy_worker(sandbox, deadline=time.monotonic() + 120)
        sock.close()
        deadline = time.monotonic() + 30
        while sandbox.snapshot()["cancelled"] == cancelled or alive(pid):
            assert time.monotonic() < deadline, "the compile went on after the client left"
            time.sleep(0.02)


def _busy_worker(sandbox: Any, deadline: float) -> int:
    """A worker compiling: 3 s of CPU time is past loading the vocabulary (under 1.5 s), into the compile
    (more than 30 s)."""
    while True:
        busy = [pid for pid in sandbox.busy_pids() if cpu_seconds(pid) > 3.0]
        if busy:
            return busy[0]
        assert time.monotonic() < deadline, "no grammar worker started compiling"
        time.sleep(0.02)
