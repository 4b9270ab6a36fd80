"""What bench_serving.py reports about InferFlux's host loop (issue 47), beside the client's clock.

The engine thread's CPU per step: InferFlux's /metrics counts the engine thread's CPU seconds
while it has work (``inferflux_engine_thread_cpu_seconds``, ``time.thread_time``, so a device
wait that releases the GIL is not in it) and its steps; read before and after a level, the
level's CPU per step is the one delta over the other. The same counters give the level's
batch: sequences sampled per step and rows (tokens through forward) per step.

On the stand-in device (``--standin-step``; docs/backends.md) each step waits a known time,
``base + per_row x rows``; ITL set against the step at the level's observed batch says how much
the host adds to the device's time: 1.0 would be a host loop that costs nothing.
"""

from __future__ import annotations

from typing import Any

import httpx

from inferflux.backends.standin import STEP_ENV, StepTime

COUNTERS = {
    "steps": "inferflux_engine_steps_total",
    "rows": "inferflux_engine_step_tokens_total",
    "sampled": "inferflux_engine_sampled_tokens_total",
    "cpu_s": "inferflux_engine_thread_cpu_seconds_total",
}

# Rows of the report: (key, label, format); shown where a level has them.
ENGINE_METRICS = [
    ("engine_cpu_ms_per_step", "engine-thread CPU per step (ms)", "{:.3f}"),
    ("batch_per_step", "sequences per step", "{:.1f}"),
    ("standin_step_ms", "stand-in step at that batch (ms)", "{:.3f}"),
    ("itl_p50_over_step", "ITL p50 / step", "{:.2f}"),
    ("itl_p90_over_step", "ITL p90 / step", "{:.2f}"),
    ("tpot_p50_over_step", "TPOT p50 / step", "{:.2f}"),
]
# The client's latencies (LevelResult's fields, ms) set against the step: (figure, latency field).
_RATIOS = (("itl_p50_over_step", "itl_ms_p50"), ("itl_p90_over_step", "itl_ms_p90"),
           ("tpot_p50_over_step", "tpot_ms_p50"))


def parse_step(text: str) -> StepTime:
    """``--standin-step``'s ``BASE_MS,PER_ROW_MS``, checked as the backend checks its variable."""
    try:
        return StepTime.parse(text)
    except ValueError as exc:
        raise SystemExit(f"--standin-step: {exc}") from None


def step_text(step: StepTime) -> str:
    """``step`` as the variable and ``--standin-step`` take it: ``BASE_MS,PER_ROW_MS``."""
    return f"{step.base_s * 1e3:g},{step.per_row_s * 1e3:g}"


def server_env(step: StepTime) -> dict[str, str]:
    """The variable that lets ``inferctl serve --backend standin`` start, with this formula."""
    return {STEP_ENV: step_text(step)}


def describe(step: StepTime) -> str:
    return f"{step.base_s * 1e3:g} ms + {step.per_row_s * 1e3:g} ms x rows"


def read_counters(base_url: str, headers: dict[str, str]) -> dict[str, float] | None:
    """The engine counters summed over models, or None (not InferFlux, or a server without them)."""
    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", params={"name[]": list(COUNTERS.values())},
                         headers=headers, timeout=10, trust_env=False)  # fmt: skip
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    sums = dict.fromkeys(COUNTERS, 0.0)
    seen = set()
    names = {name: key for key, name in COUNTERS.items()}
    for line in resp.text.splitlines():
        key = names.get(line.split("{", 1)[0].split(" ", 1)[0])
        if key is not None:
            sums[key] += float(line.rsplit(" ", 1)[1])
            seen.add(key)
    return sums if seen == set(COUNTERS) else None


def level_figures(before: dict[str, float] | None, after: dict[str, float] | None, step: StepTime | None,
                  latencies: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """A level's engine figures from the counters around it (empty without them), set against the step
    with ``latencies`` (the level's ``itl_ms_p50``, ``itl_ms_p90``, ``tpot_ms_p50``) when there is one."""
    if before is None or after is None:
        return {}
    delta = {key: after[key] - before[key] for key in COUNTERS}
    steps = delta["steps"]
    if steps <= 0:
        return {}
    figures: dict[str, Any] = {
        "engine_steps": int(steps),
        "engine_cpu_ms_per_step": delta["cpu_s"] / steps * 1e3,
        "batch_per_step": delta["sampled"] / steps,
        "rows_per_step": delta["rows"] / steps,
    }
    if step is not None:
        # The step at the decode batch: what each stream waits between two tokens if the host cost nothing.
        at_batch = step.seconds(round(figures["batch_per_step"])) * 1e3
        figures["standin_step_ms"] = at_batch
        # The formula is linear, so its value at the mean rows is the level's mean modelled step, prefills included.
        figures["standin_mean_step_ms"] = (step.base_s + step.per_row_s * figures["rows_per_step"]) * 1e3
        for name, field in _RATIOS:
            value = latencies.get(field)
            figures[name] = value / at_batch if value is not None and at_batch else None
    return figures


def method_lines(step: StepTime | None) -> list[str]:
    lines = [
        "- Engine rows (InferFlux): engine-thread CPU per step = delta `inferflux_engine_thread_cpu_seconds` / "
        "delta `inferflux_engine_steps` over the level (warm-up excluded; `time.thread_time` of the engine thread "
        "while it has work: scheduling, sampling, detokenising, handing outputs to the event loop, and on the cpu "
        "backend the model itself); sequences per step = delta sampled tokens / delta steps.",
    ]
    if step is not None:
        lines.append(
            f"- Stand-in device: `inferctl serve --backend standin` with {STEP_ENV}={step_text(step)} "
            f"(each step waits {describe(step)}, rows = tokens in the step, in `time.sleep`, which releases the GIL; "
            "logits are cheap and deterministic, tokenising, sampling, detokenising, stop strings and SSE are real). "
            "Stand-in step at that batch = the formula at the level's sequences per step (rounded); "
            "ITL / step = the ITL percentile over it: 1.00 is a host loop that adds nothing to the device's time. "
            "TPOT p50 / step likewise with each request's mean time per output token, (latency - TTFT) / "
            "(tokens - 1): ITL pools the gaps between text chunks as the client reads them, and chunks that "
            "arrive together (a step's events written at once, read in one go) make short gaps and long ones, "
            "so at many streams ITL p50 can sit below the step while TPOT says what a stream got.")
    return lines
