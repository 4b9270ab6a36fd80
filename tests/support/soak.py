"""Soak load against a served gateway: storms of streams the client abandons, and RSS probes.

Shared by ``tests/gateway/test_gateway_soak.py`` (short, in CI) and
``benchmarks/bench_soak.py`` (minutes). The gateway runs in its own process
(``soak_server.py``) so its RSS is the gateway's alone; a probe asks it, by
SIGUSR1, to collect garbage and trim the heap and report.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from replica import Replica

MODEL = "smollm2-135m-instruct"
SOAK_SERVER = Path(__file__).with_name("soak_server.py")
# Where the client stops reading before it closes the socket, in turn: before
# the answer's head, after it, and after a few chunks (mid-generation).
ABORT_POINTS = (0, 1, 3)


def start_gateway(data_dir: Path, admin_key: str, log: Path, trace: bool = False,
                  extra_args: list[str] | None = None) -> Replica:  # fmt: skip
    """``inferctl serve`` with the memory probe, ready to take requests."""
    report = data_dir.with_name(data_dir.name + "-memory.json")
    env = {
        **os.environ,
        "INFERFLUX_BOOTSTRAP_ADMIN_KEY": admin_key,
        "INFERFLUX_SOAK_REPORT": str(report),
        "INFERFLUX_SOAK_TRACE": "1" if trace else "0",
    }
    gateway = Replica("soak gateway", data_dir, env, log, extra_args, program=[sys.executable, str(SOAK_SERVER)])
    gateway.report_path = report  # type: ignore[attr-defined]
    try:
        gateway.wait_ready()
    except BaseException:
        gateway.kill()  # never leave a gateway behind a failed start
        raise
    return gateway


def probe(gateway: Replica, timeout: float = 30.0) -> dict[str, Any]:
    """The gateway's memory report after gc and malloc_trim (see soak_server.report)."""
    path: Path = gateway.report_path  # type: ignore[attr-defined]
    path.unlink(missing_ok=True)
    gateway.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or gateway.proc.poll() is not None:
            raise AssertionError(f"no memory report from the gateway:\n{gateway.output()}")
        time.sleep(0.05)
    return json.loads(path.read_text())


def stream_body(n: int, max_tokens: int) -> dict[str, Any]:
    # Distinct prompts, so the prefix cache grows too (bounded by the KV blocks).
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Story {n}: tell me about a dragon named {n * 7919 % 10007}."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


async def _abandoned_stream(url: str, key: str, body: dict[str, Any], chunks: int, timeout: float) -> str:
    """POST a stream, read ``chunks`` SSE events (0: nothing at all), then close the socket."""
    where = urlsplit(url)
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    payload = json.dumps(body).encode()
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload
    )
    outcome = "sent"
    try:
        async with asyncio.timeout(timeout):
            await writer.drain()
            if chunks:
                head = await reader.readuntil(b"\r\n\r\n")
                outcome = head.split(b"\r\n", 1)[0].decode(errors="replace")
                for _ in range(chunks - 1):
                    await reader.readuntil(b"\n\n")
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        outcome = "cut short"
    finally:
        writer.transport.abort()  # a client that vanishes: no FIN handshake, no reading the rest
    return outcome


async def storm(url: str, key: str, count: int, concurrency: int = 16, max_tokens: int = 24,
                first: int = 0, timeout: float = 60.0) -> dict[str, int]:  # fmt: skip
    """``count`` streams abandoned at the points in ABORT_POINTS, ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(n: int) -> str:
        async with gate:
            body = stream_body(first + n, max_tokens)
            return await _abandoned_stream(url, key, body, ABORT_POINTS[n % len(ABORT_POINTS)], timeout)

    outcomes: dict[str, int] = {}
    for outcome in await asyncio.gather(*(one(n) for n in range(count))):
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


async def completed(url: str, key: str, count: int, concurrency: int = 8, max_tokens: int = 24,
                    first: int = 0, timeout: float = 120.0) -> dict[str, int]:  # fmt: skip
    """``count`` requests read to the end (every other one streamed), ``concurrency`` at a time."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    headers = {"authorization": f"Bearer {key}"}

    async def one(client: httpx.AsyncClient, n: int) -> str:
        body = {**stream_body(first + n, max_tokens), "stream": n % 2 == 0}
        async with gate:
            try:
                response = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
                return str(response.status_code)
            except httpx.HTTPError as exc:
                return type(exc).__name__

    outcomes: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=timeout) as client:
        for outcome in await asyncio.gather(*(one(client, n) for n in range(count))):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


@dataclass
class Idle:
    """How the gateway's engine looked once it had nothing left to do."""

    waited_s: float


async def wait_idle(url: str, timeout: float = 60.0) -> Idle:
    """Wait until /metrics shows no running or waiting sequence (the aborts have landed)."""
    import httpx

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            text = (await client.get(url + "/metrics")).text
            busy = [
                line for line in text.splitlines()
                if line.startswith(("inferflux_engine_running_sequences", "inferflux_engine_waiting_sequences"))
                and not line.rstrip().endswith(" 0.0")
            ]  # fmt: skip
            if not busy:
                return Idle(time.monotonic() - start)
            if time.monotonic() - start > timeout:
                raise AssertionError(f"the engine is still busy after the storm: {busy}")
            await asyncio.sleep(0.1)
