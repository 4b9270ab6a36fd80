"""A drain under load: every request the server's socket accepted gets an answer, never a reset.

A real ``inferctl serve`` with two sequences a batch and a short grace takes a
steady stream of requests on fresh connections from eight clients, streamed
and not, before, during and after SIGTERM, until the process has exited.
Each request whose connection was accepted gets its whole answer (200; a
stream still running when the grace ends closes with the drain's error event
and ``[DONE]``) or an OpenAI-shaped 503 with Retry-After; only connections the
kernel refused (the listener closed) may go unanswered.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from replica import Replica

MODEL = "smollm2-135m-instruct"
GRACE = 2.0
CLIENTS = 8
pytestmark = pytest.mark.serial  # the drain is timed against its grace


@dataclass
class Outcome:
    started: float  # monotonic, when the client connected
    kind: str  # "refused" (never accepted), "answer", or "broken" (accepted, then no whole answer)
    detail: str


def ask(port: int, key: str, n: int) -> Outcome:
    """One request on a fresh connection: a stream for even ``n``, a JSON answer for odd."""
    stream = n % 2 == 0
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {n}"}], "max_tokens": 6,
            "stream": stream, "temperature": 0}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    started = time.monotonic()
    try:
        conn.connect()
    except ConnectionRefusedError as exc:
        return Outcome(started, "refused", repr(exc))
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"authorization": f"Bearer {key}", "content-type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        text = response.read().decode()
    except (OSError, http.client.HTTPException) as exc:  # reset, EOF without an answer, a cut body
        return Outcome(started, "broken", repr(exc))
    finally:
        conn.close()
    try:
        return Outcome(started, "answer", whole_answer(response, text, stream))
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return Outcome(started, "answer", f"malformed ({exc!r}): {text[:300]}")


def whole_answer(response: http.client.HTTPResponse, text: str, stream: bool) -> str:
    """"200" or "503" if the answer is whole and well formed, else what is wrong with it."""
    if response.status == 503:
        error = json.loads(text)["error"]
        shaped = set(error) == {"message", "type", "param", "code"}
        if not shaped or error["code"] != "server_shutting_down" or int(response.getheader("retry-after") or 0) < 1:
            return f"503 without server_shutting_down and Retry-After: {text} {response.getheaders()}"
        return "503"
    if response.status != 200:
        return f"{response.status}: {text[:300]}"
    if stream:
        lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        if lines[-1:] == ["[DONE]"] and '"error"' in lines[-2] and json.loads(lines[-2])["error"]["code"] == (
            "server_shutting_down"
        ):
            return "200"  # still running when the grace ended: ended in error, as the drain does
        if lines[-1:] != ["[DONE]"] or any('"error"' in line for line in lines):
            return f"a stream that did not end whole: {lines[-3:]}"
    elif not json.loads(text)["choices"][0]["message"]["content"]:
        return f"an empty answer: {text[:300]}"
    return "200"


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[tuple[Replica, str]]:
    from inferflux.policy.authn.apikeys import generate_key

    key = generate_key().token
    config = tmp_path / "config.yaml"
    config.write_text(f"server:\n  shutdown_grace_seconds: {GRACE}\nengine:\n  max_num_seqs: 2\n")
    env = {**os.environ, "INFERFLUX_BOOTSTRAP_ADMIN_KEY": key}
    env.pop("INFERFLUX_STORE_URL", None)
    server = Replica("drained", tmp_path / "data", env, tmp_path / "serve.log", ["--config", str(config)])
    try:
        server.wait_ready()
        yield server, key
    finally:
        server.stop()


def test_every_request_accepted_during_a_drain_under_load_is_answered(replica: tuple[Replica, str]) -> None:
    server, key = replica
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    exited = threading.Event()

    def client(first: int) -> None:
        n = first
        while not exited.is_set():
            try:
                outcome = ask(server.port, key, n)
            except Exception as exc:  # recorded, not lost with the thread
                outcome = Outcome(time.monotonic(), "broken", f"the client failed: {exc!r}")
            with lock:
                outcomes.append(outcome)
            n += CLIENTS
            if outcome.kind == "refused":
                time.sleep(0.01)

    workers = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 120
    while sum(o.detail == "200" for o in outcomes) < CLIENTS and time.monotonic() < deadline:
        time.sleep(0.1)  # the engine is busy and a queue has formed
    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    code = server.proc.wait(timeout=GRACE + 30)
    time.sleep(0.5)  # the clients see the listener gone
    exited.set()
    for worker in workers:
        worker.join(timeout=70)
    assert code in (0, -signal.SIGTERM), server.output()

    broken = [o for o in outcomes if o.kind == "broken" or (o.kind == "answer" and o.detail not in ("200", "503"))]
    assert not broken, [(round(o.started - signalled, 2), o.detail) for o in broken]
    in_flight = [o for o in outcomes if o.kind == "answer" and o.started < signalled]
    during = [o for o in outcomes if o.kind == "answer" and o.started >= signalled]
    assert sum(o.detail == "200" for o in in_flight) >= CLIENTS, "the load never got going"
    assert any(o.detail == "503" for o in during), "no request reached the draining server"
    log = server.output()
    assert "Traceback" not in log and " 500" not in log, log
