"""The stand-in device behind the real gateway, over a real socket: the policy chain, real
detokenised text streamed as SSE, stop strings, and the engine metrics the serving benchmark reads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from http_helpers import bearer
from servers import start_uvicorn, stop_uvicorn

from inferflux.backends.base import ModelSpec
from inferflux.backends.models import default_model_path, open_model
from inferflux.backends.standin import STEP_ENV
from inferflux.backends.standin.backend import next_tokens, ordinary_tokens
from inferflux.policy.store import PolicyStore, StoreSettings

MODEL = "standin-smollm2"
PROMPT = [1, 504, 3458, 282, 260, 2248, 30]  # token ids: the completions route takes them as they are


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, app_for_model: Any) -> Iterator[tuple[str, str]]:
    """(base URL, admin key) of a gateway serving the stand-in with a 1 ms step."""
    from inferflux.backends.engine import EngineConfig
    from inferflux.gateway.models.served import load_served_model

    patch = pytest.MonkeyPatch()
    patch.setenv(STEP_ENV, "1,0.01")
    tmp = tmp_path_factory.mktemp("standin")
    model = load_served_model(ModelSpec(name=MODEL, path=default_model_path()), "standin", EngineConfig(num_blocks=64))
    store = PolicyStore.open(StoreSettings(), tmp)
    key = str(store.ensure_bootstrap_admin())
    server, thread, sock, url = start_uvicorn(app_for_model(model, store, data_dir=str(tmp / "app")))
    try:
        yield url, key
    finally:
        stop_uvicorn(server, thread, sock)
        model.shutdown()
        store.close()
        patch.undo()


def expected_text(max_tokens: int) -> str:
    """What greedy decoding of PROMPT must give: the stand-in's next token, step after step."""
    tokenizer = open_model(default_model_path()).tokenizer()
    ordinary = ordinary_tokens(tokenizer, tokenizer.vocab_size)
    ids = list(PROMPT)
    for _ in range(max_tokens):
        top, _ = next_tokens(np.asarray(ids[-1:], dtype=np.uint64), np.asarray([len(ids) - 1], dtype=np.uint64), ordinary)
        ids.append(int(top[0]))
    return tokenizer.decode(ids[len(PROMPT):])


def sse(response: httpx.Response) -> list[dict[str, Any]]:
    events = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def stream(url: str, key: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{url}/v1/completions", headers=bearer(key), timeout=60,
                      json={"model": MODEL, "temperature": 0, "stream": True, **body}) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse(response)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", params={"name[]": [name]}, timeout=30).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f'{name}{{model="{MODEL}"}}')]
    assert len(values) == 1, text
    return values[0]


def test_a_stream_carries_the_detokenised_greedy_text(gateway: tuple[str, str]) -> None:
    url, key = gateway
    chunks = stream(url, key, {"prompt": PROMPT, "max_tokens": 24})
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == expected_text(24) and text.isascii() and len(text) > 24
    assert sum(bool(c["choices"] and c["choices"][0]["text"]) for c in chunks) >= 12  # streamed, not one lump
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_a_stop_string_ends_the_stream_before_it(gateway: tuple[str, str]) -> None:
    url, key = gateway
    full = expected_text(24)
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    chunks = stream(url, key, {"prompt": PROMPT, "max_tokens": 24, "stop": [stop]})
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == full[: full.index(stop)]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


def test_chat_runs_through_the_models_template(gateway: tuple[str, str]) -> None:
    url, key = gateway
    answer = httpx.post(f"{url}/v1/chat/completions", headers=bearer(key), timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})  # fmt: skip
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] > 8  # the chat template's tokens around "Hello"


def test_it_is_behind_the_policy_chain(gateway: tuple[str, str]) -> None:
    url, _ = gateway
    refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["message"]


def test_the_engine_metrics_move_with_each_step(gateway: tuple[str, str]) -> None:
    url, key = gateway
    names = ("inferflux_engine_steps_total", "inferflux_engine_step_tokens_total",
             "inferflux_engine_sampled_tokens_total", "inferflux_engine_thread_cpu_seconds_total")  # fmt: skip
    before = {name: metric(url, name) for name in names}
    stream(url, key, {"prompt": PROMPT, "max_tokens": 10})
    after = {name: metric(url, name) for name in names}
    moved = {name: after[name] - before[name] for name in names}
    assert moved["inferflux_engine_steps_total"] >= 10, moved  # a prefill step and 9 decode steps at least
    assert moved["inferflux_engine_sampled_tokens_total"] == 10, moved
    assert moved["inferflux_engine_step_tokens_total"] == len(PROMPT) + 9, moved
    assert moved["inferflux_engine_thread_cpu_seconds_total"] > 0, moved


def test_the_serving_benchmark_reads_the_counters_and_sets_latency_against_the_step(gateway: tuple[str, str]) -> None:
    from scripts import load_benchmark

    from inferflux.backends.standin import StepTime

    url, key = gateway
    bench = load_benchmark("serving_standin")
    before = bench.read_counters(url, {})  # /metrics needs no key
    stream(url, key, {"prompt": PROMPT, "max_tokens": 10})
    after = bench.read_counters(url, {})
    latencies = {"itl_ms_p50": 2.0, "itl_ms_p90": 4.0, "tpot_ms_p50": None}
    figures = bench.level_figures(before, after, StepTime.parse("1,0.01"), latencies)
    steps = figures["engine_steps"]
    assert steps == after["steps"] - before["steps"] >= 10
    assert figures["batch_per_step"] == pytest.approx(10 / steps)
    assert figures["rows_per_step"] == pytest.approx((len(PROMPT) + 9) / steps)
    assert figures["engine_cpu_ms_per_step"] == pytest.approx((after["cpu_s"] - before["cpu_s"]) / steps * 1e3)
    assert figures["engine_cpu_ms_per_step"] > 0
    step_ms = 1 + 0.01 * round(10 / steps)
    assert figures["standin_step_ms"] == pytest.approx(step_ms)
    assert figures["itl_p50_over_step"] == pytest.approx(2.0 / step_ms)
    assert figures["tpot_p50_over_step"] is None  # no figure, no ratio
    # Without a formula: the CPU per step, no ratios; without counters (not InferFlux): nothing.
    assert "itl_p50_over_step" not in bench.level_figures(before, after, None, latencies)
    assert bench.read_counters("http://127.0.0.1:9", {}) is None
    assert bench.level_figures(None, after, None, latencies) == {}
