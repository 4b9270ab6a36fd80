#!/usr/bin/env python3
"""InferFlux in front of an upstream (backend ``openai``, the whole policy chain) against LiteLLM proxy.

Method
------
Three processes on loopback, one worker each, started by this script:

* the fake upstream (``tests/support/fake_upstream.py`` as its own process): an
  OpenAI-compatible server that answers at once with canned tokens;
* InferFlux: ``inferctl serve`` (SQLite store, audit on as by default: each
  event written to the spool before the answer) with one model, backend
  ``openai``, served by the fake upstream (an upstream key from
  ``api_key_env``); over the admin API with the bootstrap admin key: a tenant
  and a ``member`` API key (what the clients use: authentication and RBAC), a
  tenant ``rate_limit`` (requests, tokens, concurrency) and a monthly
  ``quota`` set far above what the run uses, a tenant guardrail policy (20
  blocklist words and every PII detector on input and output, e-mail
  redacted), and a global guardrail policy with an embedded Rego access policy
  that allows everything but ``max_tokens: 7``. Before measuring, a blocked word
  and ``max_tokens: 7`` must both be refused and the refusals be in the audit
  trail (admin API): the chain is checked to be on;
* LiteLLM proxy, pinned (``--litellm-version``), in its own virtual
  environment outside the repository (made with pip when missing), configured
  with only a master key and one model, ``openai/<name>`` with ``api_base`` the
  fake upstream, started with its CLI and ``--num_workers 1``.

The three targets are the fake upstream *direct*, *inferflux* and *litellm*;
every answer is checked to be the fake's text. The request is a chat
completion whose user message holds an e-mail address, ``max_tokens``
``--max-tokens`` (the fake then sends that many tokens, one per stream chunk).

Latency: ``--rounds`` rounds; in each, every target (in a rotating order)
gets ``--requests`` sequential non-streaming requests, then as many streaming
ones, over one keep-alive connection from a minimal blocking HTTP/1.1 client
(httptools' parser; no client library's overhead in the figures). Streaming:
time to first token (the first event with content) and to the last byte. The
*added* latency of a proxy at p50 is the median over rounds of (its round p50
minus direct's round p50): the machine drifts between rounds by more than the
differences measured; p99 is over every request of a target.

Throughput: ``--throughput-rounds`` rounds; in each, every target (rotating)
is loaded by ``--concurrency`` keep-alive connections for ``--duration``
seconds, non-streaming then streaming. The load generator is ``wrk`` (one
thread, C, Debian's package) when it is on PATH, else this script's own
asyncio + httptools client in a separate process (the report says which).
Requests/s (streams/s) are medians over rounds.

Machine load: before starting, the script waits (``--quiet-wait`` minutes at
most) for the 1-minute load average to fall to ``--quiet-load``; it reports the
load averages before and after, and the CPU that processes other than its own
used during the run (``/proc/stat`` busy time minus this process tree's).
The CPU model comes from ``lscpu``.

Usage:
    .venv/bin/python benchmarks/bench_upstream.py [--rounds 10] [--requests 100] [--concurrency 32]
        [--duration 10] [--throughput-rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests" / "support"))

from bench_auth import pct  # noqa: E402  (this folder is on sys.path)
from bench_fairness import Server, cpu_model, free_port  # noqa: E402
from fake_upstream import TOKENS, FakeUpstreamProcess  # noqa: E402

MODEL = "bench-model"
PROMPT = "Please write back to jane.doe@example.com about the weather in Lisbon next week."
WORDS = [f"blockedword{i}" for i in range(20)]
REGO = """package inferflux.guardrails
default decision := {"allow": true}
decision := {"allow": false, "reasons": ["seven is refused"]} if { input.tokens.max_completion == 7 }
"""
LITELLM_VERSION = "1.106.2"
MASTER_KEY = "sk-bench-master-key"
TARGETS = ("direct", "inferflux", "litellm")
TARGET_ADDED_P50_MS = 1.0  # issue 20: added latency at p50 at most this
TARGET_RPS_RATIO = 20.0  # and requests/s at least this many times LiteLLM's


# -- a minimal HTTP/1.1 client (sequential latency, and the load generator without wrk)


class _Response:
    """httptools callbacks for one response: its body, and when its first content token arrived."""

    EVENT_END = re.compile(rb"\r?\n\r?\n")

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.body = bytearray()
        self.done = False
        self.first: float | None = None
        self._scanned = 0

    def on_body(self, data: bytes) -> None:
        self.body += data
        if self.stream and self.first is None:
            self._scan()

    def on_message_complete(self) -> None:
        self.done = True

    def _scan(self) -> None:
        while True:
            end = self.EVENT_END.search(self.body, self._scanned)
            if end is None:
                return
            event = bytes(self.body[self._scanned : end.start()])
            self._scanned = end.end()
            if _event_text(event):
                self.first = time.perf_counter()
                return


def _event_text(event: bytes) -> str:
    """The content of one SSE event of a chat stream ('' for a role, finish, usage or [DONE] event)."""
    if not event.startswith(b"data:"):
        return ""
    payload = event[5:].strip()
    if payload == b"[DONE]":
        return ""
    choices = json.loads(payload).get("choices") or []
    delta = choices[0].get("delta") or {} if choices else {}
    return delta.get("content") or ""


def answer_text(body: bytes, stream: bool) -> str:
    """The assistant's text of a whole answer (every event's content, for a stream)."""
    if not stream:
        return str(json.loads(body)["choices"][0]["message"]["content"])
    return "".join(_event_text(e) for e in _Response.EVENT_END.split(bytes(body)))


@dataclass
class Target:
    name: str
    port: int
    headers: dict[str, str]

    def raw(self, stream: bool, max_tokens: int, prompt: str = PROMPT) -> bytes:
        """The whole request, encoded once: every request of a batch is these bytes."""
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": max_tokens, "stream": stream}).encode()  # fmt: skip
        head = [f"POST /v1/chat/completions HTTP/1.1", f"Host: 127.0.0.1:{self.port}",
                "Content-Type: application/json", f"Content-Length: {len(body)}",
                *(f"{k}: {v}" for k, v in self.headers.items())]  # fmt: skip
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Connection:
    """One blocking keep-alive connection; ``exchange`` sends one request and reads its whole answer."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=120)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def exchange(self, raw: bytes, stream: bool) -> tuple[int, float, float | None, bytes]:
        """(status, seconds to the last byte, seconds to the first token or None, body)."""
        start = time.perf_counter()
        self.sock.sendall(raw)
        response = _Response(stream)
        parser = httptools.HttpResponseParser(response)
        while not response.done:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError(f"port {self.port} closed the connection mid-answer")
            parser.feed_data(data)
        end = time.perf_counter()
        if not parser.should_keep_alive():
            self.sock.close()
            self.sock = self._connect()
        first = None if response.first is None else response.first - start
        return parser.get_status_code(), end - start, first, bytes(response.body)

    def close(self) -> None:
        self.sock.close()


def sequential(target: Target, n: int, stream: bool, max_tokens: int) -> tuple[list[float], list[float]]:
    """``n`` requests in a row on one connection: their times to the last byte, and to the first token."""
    raw = target.raw(stream, max_tokens)
    conn = Connection(target.port)
    total, first = [], []
    try:
        for _ in range(n):
            status, elapsed, ttft, body = conn.exchange(raw, stream)
            if status != 200:
                raise SystemExit(f"{target.name}: unexpected {status}: {body[:300]!r}")
            total.append(elapsed)
            if stream:
                if ttft is None:
                    raise SystemExit(f"{target.name}: a stream ended without a token")
                first.append(ttft)
    finally:
        conn.close()
    return total, first


# -- load generation: wrk, else a Python client in a separate process


def wrk_version() -> str | None:
    if shutil.which("wrk") is None:
        return None
    out = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False)
    return (out.stdout + out.stderr).strip().splitlines()[0].split(" Copyright")[0]


def _lua_string(text: str) -> str:
    return f"[==[{text}]==]"


def _wrk_ms(value: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", value).groups()  # type: ignore[union-attr]
    return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}[unit]


def load_wrk(target: Target, stream: bool, args: argparse.Namespace) -> dict[str, float]:
    """``wrk -t1 -c<concurrency> -d<duration>``: requests/s and latency p50/p99 under load."""
    raw = target.raw(stream, args.max_tokens)
    body = raw.split(b"\r\n\r\n", 1)[1].decode()
    lines = ['wrk.method = "POST"', f"wrk.body = {_lua_string(body)}",
             'wrk.headers["Content-Type"] = "application/json"',
             *(f'wrk.headers["{k}"] = {_lua_string(v)}' for k, v in target.headers.items())]  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write("\n".join(lines) + "\n")
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{args.concurrency}", f"-d{args.duration}s", "--timeout", "30s", "--latency",
             "-s", script.name, f"http://127.0.0.1:{target.port}/v1/chat/completions"],
            capture_output=True, text=True, check=True, timeout=args.duration + 60,
        ).stdout  # fmt: skip
    finally:
        os.unlink(script.name)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    if bad or errors:
        raise SystemExit(f"{target.name}: wrk saw failures:\n{out}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _wrk_ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p99 = _wrk_ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    return {"rps": rps, "p50_ms": p50, "p99_ms": p99}


async def _load_python(port: int, raw: bytes, stream: bool, concurrency: int, duration: float) -> dict[str, float]:
    latencies: list[float] = []
    deadline = time.perf_counter() + duration

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                writer.write(raw)
                response = _Response(False)  # no token scanning under load
                parser = httptools.HttpResponseParser(response)
                while not response.done:
                    data = await reader.read(65536)
                    if not data:
                        raise ConnectionError("the server closed the connection")
                    parser.feed_data(data)
                if parser.get_status_code() != 200:
                    raise SystemExit(f"unexpected {parser.get_status_code()}: {bytes(response.body)[:300]!r}")
                end = time.perf_counter()
                if end <= deadline:
                    latencies.append(end - start)
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = min(time.perf_counter(), deadline) - start
    return {"rps": len(latencies) / elapsed, "p50_ms": pct(latencies, 50) * 1000, "p99_ms": pct(latencies, 99) * 1000}


def load_python(target: Target, stream: bool, args: argparse.Namespace) -> dict[str, float]:
    """This script's own load generator, in a child process so that it does not share this one's GIL."""
    job = {"port": target.port, "raw": target.raw(stream, args.max_tokens).decode(), "stream": stream,
           "concurrency": args.concurrency, "duration": args.duration}  # fmt: skip
    out = subprocess.run([sys.executable, __file__, "--loadgen", json.dumps(job)], capture_output=True,
                         text=True, check=True, timeout=args.duration + 60).stdout  # fmt: skip
    return dict(json.loads(out))


# -- the servers


def litellm_ready(venv: Path, version: str) -> str:
    """LiteLLM's version in ``venv``, installing it (pinned, with the proxy extra) when it is missing."""
    python = venv / "bin" / "python"
    query = [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"]
    found = subprocess.run(query, capture_output=True, text=True, check=False) if python.exists() else None
    if found is None or found.returncode != 0 or (version and found.stdout.strip() != version):
        print(f"installing litellm[proxy]{'==' + version if version else ''} into {venv} ...", flush=True)
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        spec = f"litellm[proxy]=={version}" if version else "litellm[proxy]"
        subprocess.run([str(python), "-m", "pip", "install", "-q", spec], check=True)
        found = subprocess.run(query, capture_output=True, text=True, check=True)
    return found.stdout.strip()


class LiteLLM:
    """``litellm --config`` on a loopback port: a master key and one model, nothing else (no database)."""

    def __init__(self, venv: Path, upstream_url: str) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="bench-litellm-"))
        config = {
            "model_list": [{"model_name": MODEL, "litellm_params": {
                "model": f"openai/{MODEL}", "api_base": upstream_url, "api_key": "sk-upstream"}}],
            "general_settings": {"master_key": MASTER_KEY},
        }  # fmt: skip
        (self.dir / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
        # The cost map is otherwise fetched from the internet at import.
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
        env.pop("PYTHONPATH", None)
        self.log = open(self.dir / "litellm.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(venv / "bin" / "litellm"), "--config", str(self.dir / "config.yaml"), "--host", "127.0.0.1",
             "--port", str(self.port), "--num_workers", "1"],
            cwd=self.dir, env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"litellm exited: see {self.log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health/liveliness", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"litellm did not get ready in {timeout} s: see {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


def inferflux_config(upstream_url: str) -> Path:
    # The fake upstream is on loopback: a private address, which the gateway reaches only where it is allowed.
    config = {"models": [{"name": MODEL, "backend": "openai",
                          "upstream": {"endpoints": [upstream_url], "api_key_env": "INFERFLUX_UPSTREAM_BENCH_KEY"}}],
              "upstreams": {"allowed_hosts": ["127.0.0.1"]}}  # fmt: skip
    path = Path(tempfile.mkdtemp(prefix="bench-upstream-")) / "inferflux.yaml"
    path.write_text(json.dumps(config))
    return path


def full_chain(server: Server) -> tuple[str, str]:
    """The tenant, its member key and every policy, over the admin API; returns (the tenant's id, the key)."""
    admin = {"authorization": f"Bearer {server.admin_key}"}

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(server.url + "/admin/v1" + path, json=body, headers=admin, timeout=30)
        if response.status_code >= 300:
            raise SystemExit(f"POST {path}: {response.status_code} {response.text}")
        return dict(response.json())

    tenant = post("/tenants", {"name": "bench"})["id"]
    key = str(post(f"/tenants/{tenant}/keys", {"name": "bench", "role": "member"})["key"])
    post(f"/tenants/{tenant}/policies", {"kind": "rate_limit", "name": "bench", "spec": {
        "scope": "tenant", "requests_per_minute": 10_000_000, "tokens_per_minute": 10**10,
        "concurrent_requests": 10_000}})  # fmt: skip
    post(f"/tenants/{tenant}/policies", {"kind": "quota", "name": "bench",
                                         "spec": {"scope": "tenant", "period": "month", "tokens": 10**12}})  # fmt: skip
    pii = {kind: "log" for kind in ("phone", "card", "iban", "ssn", "ip", "secret")}
    post("/guardrails", {"tenant_id": tenant, "name": "bench", "spec": {
        "direction": "both", "blocklist": [{"id": f"w{i}", "literal": w} for i, w in enumerate(WORDS)],
        "pii": {"email": "redact", **pii}}})  # fmt: skip
    post("/guardrails", {"tenant_id": None, "name": "access", "spec": {"opa": {"engine": "embedded", "rego": REGO}}})
    return tenant, key


def check_chain(target: Target, max_tokens: int) -> None:
    """Refuse to measure unless the guardrail and the Rego policy both act (policies may take a poll to apply)."""
    conn = Connection(target.port)
    deadline = time.monotonic() + 30
    try:
        while True:
            blocked = conn.exchange(target.raw(False, max_tokens, prompt=f"say {WORDS[3]} please"), False)[0]
            denied = conn.exchange(target.raw(False, 7), False)[0]
            if blocked >= 400 and denied >= 400:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"the policy chain is not on: a blocked word got {blocked}, max_tokens 7 got {denied}")
            time.sleep(0.5)
    finally:
        conn.close()


def check_audit(server: Server, tenant: str) -> None:
    """The refusals ``check_chain`` caused are in the audit trail (indexed a moment after they are spooled)."""
    admin = {"authorization": f"Bearer {server.admin_key}"}
    deadline = time.monotonic() + 30
    while True:
        found = httpx.get(f"{server.url}/admin/v1/tenants/{tenant}/audit", params={"decision": "deny", "kind": "api"},
                          headers=admin, timeout=30)  # fmt: skip
        if found.status_code == 200 and found.json()["data"]:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"no audit event of the refused requests: {found.status_code} {found.text[:300]}")
        time.sleep(0.5)


# -- machine load


def _jiffies(pid: int | str) -> int:
    """utime + stime + cutime + cstime of one process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return sum(int(x) for x in fields[11:15])


def _tree(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(child for child, parent in parents.items() if parent == pid)
    return tree


def cpu_snapshot() -> tuple[float, int, int]:
    """(time, busy jiffies of the machine, jiffies of this process tree)."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = sum(values[:3]) + values[5] + values[6]  # user, nice, system, irq, softirq (not idle, iowait, steal)
    return time.monotonic(), busy, sum(_jiffies(pid) for pid in _tree(os.getpid()))


def others_cores(before: tuple[float, int, int], after: tuple[float, int, int]) -> float:
    """Cores' worth of CPU that processes outside this tree used between two snapshots."""
    hz = os.sysconf("SC_CLK_TCK")
    return ((after[1] - before[1]) - (after[2] - before[2])) / hz / (after[0] - before[0])


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def wait_for_quiet(limit: float, minutes: float) -> list[list[float]]:
    """Poll the 1-minute load average each minute until it is at most ``limit`` (or time is up); the readings."""
    readings = [loadavg()]
    deadline = time.monotonic() + minutes * 60
    while readings[-1][0] > limit and time.monotonic() < deadline:
        print(f"load average {readings[-1]} above {limit}: waiting a minute", flush=True)
        time.sleep(60)
        readings.append(loadavg())
    return readings


# -- the run


@dataclass
class Measured:
    json_total: list[list[float]] = field(default_factory=list)  # per round, each request's seconds
    stream_total: list[list[float]] = field(default_factory=list)
    stream_first: list[list[float]] = field(default_factory=list)
    load_json: list[dict[str, float]] = field(default_factory=list)  # per throughput round
    load_stream: list[dict[str, float]] = field(default_factory=list)


def _rotated(names: tuple[str, ...], r: int) -> tuple[str, ...]:
    return names[r % len(names):] + names[: r % len(names)]


def measure(targets: dict[str, Target], args: argparse.Namespace, load: Any) -> dict[str, Measured]:
    expected = "".join(TOKENS[i % len(TOKENS)] for i in range(args.max_tokens))
    for target in targets.values():  # warm-up, and every target answers the fake's text
        for stream in (False, True):
            conn = Connection(target.port)
            for _ in range(args.warmup):
                status, _, _, body = conn.exchange(target.raw(stream, args.max_tokens), stream)
                if status != 200 or answer_text(body, stream) != expected:
                    raise SystemExit(f"{target.name}: unexpected answer {status}: {body[:400]!r}")
            conn.close()
    out = {name: Measured() for name in targets}
    for r in range(args.rounds):
        for name in _rotated(tuple(targets), r):
            total, _ = sequential(targets[name], args.requests, False, args.max_tokens)
            out[name].json_total.append(total)
            total, first = sequential(targets[name], args.requests, True, args.max_tokens)
            out[name].stream_total.append(total)
            out[name].stream_first.append(first)
        print(f"latency round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {pct(out[n].json_total[-1], 50) * 1000:.2f} ms" for n in targets), flush=True)  # fmt: skip
    for r in range(args.throughput_rounds):
        for stream in (False, True):
            for name in _rotated(tuple(targets), r):
                result = load(targets[name], stream, args)
                (out[name].load_stream if stream else out[name].load_json).append(result)
        print(f"throughput round {r + 1}/{args.throughput_rounds}: " + ", ".join(
            f"{n} {out[n].load_json[-1]['rps']:.0f}/{out[n].load_stream[-1]['rps']:.0f}" for n in targets),
            flush=True)  # fmt: skip
    return out


def _p50(rounds: list[list[float]]) -> float:
    return statistics.median(pct(r, 50) for r in rounds) * 1000


def _p99(rounds: list[list[float]]) -> float:
    return pct([x for r in rounds for x in r], 99) * 1000


def summarise(measured: dict[str, Measured]) -> dict[str, Any]:
    series = {"json": "json_total", "stream_ttlb": "stream_total", "stream_ttft": "stream_first"}
    latency = {
        name: {f"{s}_{q}_ms": f(getattr(m, attr)) for s, attr in series.items() for q, f in (("p50", _p50), ("p99", _p99))}
        for name, m in measured.items()
    }
    direct = measured["direct"]
    added: dict[str, Any] = {}
    for name in ("inferflux", "litellm"):
        m, row = measured[name], {}
        for s, attr in series.items():
            paired = [(pct(a, 50) - pct(b, 50)) * 1000 for a, b in zip(getattr(m, attr), getattr(direct, attr))]
            row[f"{s}_p50_ms"] = statistics.median(paired)
            row[f"{s}_p50_ms_by_round"] = [round(x, 3) for x in paired]
            row[f"{s}_p99_ms"] = _p99(getattr(m, attr)) - _p99(getattr(direct, attr))
        added[name] = row
    throughput = {
        name: {
            "json_rps": statistics.median(x["rps"] for x in m.load_json),
            "json_rps_rounds": [round(x["rps"], 1) for x in m.load_json],
            "json_p50_ms_under_load": statistics.median(x["p50_ms"] for x in m.load_json),
            "json_p99_ms_under_load": statistics.median(x["p99_ms"] for x in m.load_json),
            "streams_per_s": statistics.median(x["rps"] for x in m.load_stream),
            "streams_per_s_rounds": [round(x["rps"], 1) for x in m.load_stream],
            "stream_p50_ms_under_load": statistics.median(x["p50_ms"] for x in m.load_stream),
            "stream_p99_ms_under_load": statistics.median(x["p99_ms"] for x in m.load_stream),
        }
        for name, m in measured.items()
    }
    ratios = {
        "json_rps_inferflux_over_litellm": throughput["inferflux"]["json_rps"] / throughput["litellm"]["json_rps"],
        "streams_inferflux_over_litellm": throughput["inferflux"]["streams_per_s"] / throughput["litellm"]["streams_per_s"],
        "json_rps_inferflux_over_direct": throughput["inferflux"]["json_rps"] / throughput["direct"]["json_rps"],
        "streams_inferflux_over_direct": throughput["inferflux"]["streams_per_s"] / throughput["direct"]["streams_per_s"],
    }  # fmt: skip
    targets = {
        "added_p50_ms_at_most": TARGET_ADDED_P50_MS,
        "rps_ratio_at_least": TARGET_RPS_RATIO,
        "added_p50_met": {s: added["inferflux"][f"{s}_p50_ms"] <= TARGET_ADDED_P50_MS for s in series},
        "rps_ratio_met": {
            "json": ratios["json_rps_inferflux_over_litellm"] >= TARGET_RPS_RATIO,
            "stream": ratios["streams_inferflux_over_litellm"] >= TARGET_RPS_RATIO,
        },
    }
    return {"latency": latency, "added": added, "throughput": throughput, "ratios": ratios, "targets": targets}


def report(result: dict[str, Any]) -> None:
    print(__doc__.split("Usage:")[0].strip())
    print(f"\ncpu: {result['cpu']}; load generator: {result['load_generator']}; litellm {result['litellm_version']}")
    load = result["load"]
    print(f"load average before {load['before']}, after {load['after']}; "
          f"other processes used {load['others_cores_during_run']:.2f} cores during the run")  # fmt: skip
    print(f"\n{result['rounds']} rounds x {result['requests']} sequential requests per target and mode "
          f"(max_tokens {result['max_tokens']}):")  # fmt: skip
    print("| target | non-streaming p50 / p99 ms | stream, last byte p50 / p99 ms | stream, first token p50 / p99 ms |")
    print("|---|---|---|---|")
    for name, row in result["latency"].items():
        print(f"| {name} | {row['json_p50_ms']:.2f} / {row['json_p99_ms']:.2f} | {row['stream_ttlb_p50_ms']:.2f} / "
              f"{row['stream_ttlb_p99_ms']:.2f} | {row['stream_ttft_p50_ms']:.2f} / {row['stream_ttft_p99_ms']:.2f} |")
    print("\nadded to direct (p50: median over rounds of the paired round p50s; p99: over every request):")
    print("| proxy | non-streaming p50 / p99 ms | stream, last byte p50 / p99 ms | stream, first token p50 / p99 ms |")
    print("|---|---|---|---|")
    for name, row in result["added"].items():
        print(f"| {name} | {row['json_p50_ms']:+.2f} / {row['json_p99_ms']:+.2f} | {row['stream_ttlb_p50_ms']:+.2f} / "
              f"{row['stream_ttlb_p99_ms']:+.2f} | {row['stream_ttft_p50_ms']:+.2f} / {row['stream_ttft_p99_ms']:+.2f} |")
    print(f"\nthroughput, {result['concurrency']} connections x {result['duration']} s, "
          f"{result['throughput_rounds']} rounds (medians):")  # fmt: skip
    print("| target | requests/s | p50 / p99 ms under load | streams/s | p50 / p99 ms under load |")
    print("|---|---|---|---|---|")
    for name, row in result["throughput"].items():
        print(f"| {name} | {row['json_rps']:.1f} {row['json_rps_rounds']} | {row['json_p50_ms_under_load']:.1f} / "
              f"{row['json_p99_ms_under_load']:.1f} | {row['streams_per_s']:.1f} {row['streams_per_s_rounds']} | "
              f"{row['stream_p50_ms_under_load']:.1f} / {row['stream_p99_ms_under_load']:.1f} |")
    ratios, targets = result["ratios"], result["targets"]
    print(f"\ninferflux / litellm: requests/s {ratios['json_rps_inferflux_over_litellm']:.2f}x, "
          f"streams/s {ratios['streams_inferflux_over_litellm']:.2f}x (target >= {TARGET_RPS_RATIO:g}x: "
          f"{targets['rps_ratio_met']})")  # fmt: skip
    print(f"inferflux added at p50 (target <= {TARGET_ADDED_P50_MS:g} ms): {targets['added_p50_met']}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    litellm_version = litellm_ready(args.litellm_venv, args.litellm_version)
    wrk = None if args.python_load else wrk_version()
    readings = wait_for_quiet(args.quiet_load, args.quiet_wait) if args.quiet_wait > 0 else [loadavg()]
    os.environ["INFERFLUX_UPSTREAM_BENCH_KEY"] = "sk-upstream"  # what inferctl serve sends upstream (api_key_env)
    fake = FakeUpstreamProcess(free_port(), name="bench").start()
    inferflux = litellm = None
    try:
        inferflux = Server(REPO_ROOT, sys.executable, ["--config", str(inferflux_config(fake.url))])
        litellm = LiteLLM(args.litellm_venv, fake.url)
        inferflux.wait_ready()
        litellm.wait_ready()
        tenant, key = full_chain(inferflux)
        targets = {
            "direct": Target("direct", fake.port, {}),
            "inferflux": Target("inferflux", inferflux.port, {"Authorization": f"Bearer {key}"}),
            "litellm": Target("litellm", litellm.port, {"Authorization": f"Bearer {MASTER_KEY}"}),
        }
        check_chain(targets["inferflux"], args.max_tokens)
        check_audit(inferflux, tenant)
        before = cpu_snapshot()
        load_before = loadavg()
        measured = measure(targets, args, load_wrk if wrk else load_python)
        others = others_cores(before, cpu_snapshot())
        load_after = loadavg()
    finally:
        for server in (litellm, inferflux):
            if server is not None:
                server.stop()
        fake.stop()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "commit": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True,
                                 text=True, check=False).stdout.strip(),
        "litellm_version": litellm_version,
        "load_generator": f"{wrk}, one thread" if wrk else "python asyncio + httptools, a separate process",
        "rounds": args.rounds, "requests": args.requests, "max_tokens": args.max_tokens,
        "concurrency": args.concurrency, "duration": args.duration, "throughput_rounds": args.throughput_rounds,
        "load": {"waited": readings, "before": load_before, "after": load_after,
                 "others_cores_during_run": others},  # fmt: skip
        **summarise(measured),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("Method")[0].strip())
    parser.add_argument("--rounds", type=int, default=10, help="latency rounds (each target once per round)")
    parser.add_argument("--requests", type=int, default=100, help="sequential requests per target, mode and round")
    parser.add_argument("--warmup", type=int, default=20, help="requests per target and mode before measuring")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens in each answer (stream chunks)")
    parser.add_argument("--concurrency", type=int, default=32, help="connections of the load generator")
    parser.add_argument("--duration", type=int, default=10, help="seconds of each throughput measurement")
    parser.add_argument("--throughput-rounds", type=int, default=3)
    parser.add_argument("--python-load", action="store_true", help="use the Python load generator even with wrk")
    parser.add_argument("--litellm-venv", type=Path, default=Path("/tmp/litellm-venv"))
    parser.add_argument("--litellm-version", default=LITELLM_VERSION, help="'' for the newest")
    parser.add_argument("--quiet-load", type=float, default=0.7, help="wait for the 1-minute load average to be this")
    parser.add_argument("--quiet-wait", type=float, default=20, help="minutes to wait for it at most (0: don't)")
    parser.add_argument("--loadgen", help=argparse.SUPPRESS)  # the Python load generator's own process
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    if args.loadgen:
        job = json.loads(args.loadgen)
        print(json.dumps(asyncio.run(_load_python(job["port"], job["raw"].encode(), job["stream"],
                                                  job["concurrency"], job["duration"]))))  # fmt: skip
        return
    result = run(args)
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
