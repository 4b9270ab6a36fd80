#!/usr/bin/env python3
"""Fair sharing between tenants: one tenant's flood against another's single requests.

Method
------
A real gateway (``inferctl serve`` with its default engine configuration, the
bundled SmolLM2 on the CPU backend) on a loopback port, and two tenants with
their own member keys, made over the admin API:

* tenant A keeps ``--streams`` streaming completions in flight (closed loop: each
  client sends its next request as soon as one ends), ``--a-max-tokens`` tokens
  each, ``ignore_eos``;
* tenant B sends one streaming request at a time (``--b-max-tokens`` tokens),
  ``--requests`` of them, ``--pause`` seconds apart.

B's time to first token (TTFT: from sending the request to its first content
chunk) is measured first on the idle server, then under A's flood (after
``--warmup`` seconds of it). Reported: medians of B's TTFT idle and flooded, their
ratio, and each tenant's generated tokens/s (content chunks, one token each)
over the flooded window. The CPU model comes from ``lscpu``.

``--repo DIR`` serves the code of another checkout (for a before/after on the
same machine: ``git worktree`` or ``git archive`` of an older commit).

Usage:
    .venv/bin/python benchmarks/bench_fairness.py [--streams 64] [--requests 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def new_admin_key(python: str, repo: Path) -> str:
    code = "from inferflux.policy.authn.apikeys import generate_key; print(generate_key().token)"
    return subprocess.run([python, "-c", code], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


class Server:
    """``inferctl serve`` on a loopback port, its data in a temporary directory."""

    def __init__(self, repo: Path, python: str, extra: list[str], *, port: int | None = None,
                 admin_key: str | None = None, env: dict[str, str] | None = None) -> None:  # fmt: skip
        """``port`` (default: a free one) and ``admin_key`` (default: a new one) let a restart keep both.

        ``env``: variables added to this process's environment for the server.
        """
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data = tempfile.mkdtemp(prefix="bench-fairness-")
        self.admin_key = admin_key or new_admin_key(python, repo)
        env = {**os.environ, **(env or {}), "INFERFLUX_BOOTSTRAP_ADMIN_KEY": self.admin_key, "PYTHONPATH": str(repo)}
        self.log = open(Path(self.data) / "serve.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [python, "-m", "inferflux.gateway.cli", "serve", "--port", str(self.port), "--data-dir", self.data,
             "--log-level", "warning", *extra],
            cwd=repo, env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited: see {self.log.name}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit("the server did not get ready in time")

    def member_key(self, tenant: str) -> str:
        admin = {"authorization": f"Bearer {self.admin_key}"}
        made = httpx.post(self.url + "/admin/v1/tenants", json={"name": tenant}, headers=admin, timeout=30)
        made.raise_for_status()
        key = httpx.post(self.url + f"/admin/v1/tenants/{made.json()['id']}/keys",
                         json={"name": "bench", "role": "member"}, headers=admin, timeout=30)  # fmt: skip
        key.raise_for_status()
        return str(key.json()["key"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


async def stream(client: httpx.AsyncClient, key: str, max_tokens: int, tokens: list[float]) -> float:
    """One streamed completion; appends the time of each content chunk to ``tokens``; returns its TTFT."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    start = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise SystemExit(f"unexpected {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                now = time.perf_counter()
                first = first if first is not None else now - start
                tokens.append(now)
    if first is None:
        raise SystemExit("a stream ended without a token")
    return first


async def b_requests(client: httpx.AsyncClient, key: str, args: argparse.Namespace, tokens: list[float]) -> list[float]:
    ttfts = []
    for _ in range(args.requests):
        ttfts.append(await stream(client, key, args.b_max_tokens, tokens))
        await asyncio.sleep(args.pause)
    return ttfts


async def measure(url: str, a_key: str, b_key: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await stream(client, b_key, 2, [])  # warm: first-request costs are not B's TTFT
        idle = await b_requests(client, b_key, args, [])

        a_tokens: list[float] = []
        stop = asyncio.Event()

        async def flood_client() -> None:
            while not stop.is_set():
                await stream(client, a_key, args.a_max_tokens, a_tokens)

        flood = [asyncio.ensure_future(flood_client()) for _ in range(args.streams)]
        await asyncio.sleep(args.warmup)
        b_tokens: list[float] = []
        start = time.perf_counter()
        flooded = await b_requests(client, b_key, args, b_tokens)
        end = time.perf_counter()
        stop.set()
        await asyncio.gather(*flood)

    window = end - start
    a_in_window = sum(1 for t in a_tokens if start <= t <= end)
    return {
        "b_ttft_idle_s": idle,
        "b_ttft_flooded_s": flooded,
        "b_ttft_idle_median_s": statistics.median(idle),
        "b_ttft_flooded_median_s": statistics.median(flooded),
        "ratio": statistics.median(flooded) / statistics.median(idle),
        "window_s": window,
        "a_tokens_per_s": a_in_window / window,
        "b_tokens_per_s": len(b_tokens) / window,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64, help="tenant A's streams in flight")
    parser.add_argument("--a-max-tokens", type=int, default=128)
    parser.add_argument("--b-max-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=5, help="B's requests, idle and flooded each")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between two of B's requests")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of A's flood before B starts")
    parser.add_argument("--repo", type=Path, default=REPO_ROOT, help="the checkout to serve")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra argument for inferctl serve")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    server = Server(args.repo.resolve(), sys.executable, args.serve_arg)
    try:
        server.wait_ready()
        a_key, b_key = server.member_key("tenant-a"), server.member_key("tenant-b")
        result = asyncio.run(measure(server.url, a_key, b_key, args))
    finally:
        server.stop()
    result = {
        "method": f"inferctl serve (default engine configuration) on loopback; A: {args.streams} streams of "
        f"{args.a_max_tokens} tokens in a closed loop; B: one request of {args.b_max_tokens} tokens at a time, "
        f"{args.requests} idle then {args.requests} after {args.warmup:g} s of A's flood; medians",
        "cpu": cpu_model(),
        "repo": str(args.repo.resolve()),
        **result,
    }
    print(f"method: {result['method']}")
    print(f"cpu:    {result['cpu']}")
    print(f"B TTFT idle:    median {result['b_ttft_idle_median_s']:.3f} s  {[round(x, 3) for x in result['b_ttft_idle_s']]}")
    print(f"B TTFT flooded: median {result['b_ttft_flooded_median_s']:.3f} s  "
          f"{[round(x, 3) for x in result['b_ttft_flooded_s']]}  ({result['ratio']:.1f}x idle)")  # fmt: skip
    print(f"tokens/s over the flooded window ({result['window_s']:.1f} s): "
          f"A {result['a_tokens_per_s']:.1f}, B {result['b_tokens_per_s']:.1f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
