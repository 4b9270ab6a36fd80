"""What bench_serving.py measures beside the client's own clock: the server's KV-cache
utilisation while a level runs, and the plots of a run.

KV utilisation is read from InferFlux's /metrics (``inferflux_kv_slots_used`` and
``inferflux_kv_slots_allocated``, summed over models) every ``interval`` seconds, asking for
those two series only (``?name[]=``): the server under test renders two gauges, not every
histogram, so the sampling costs it little; a server without those series (llama-server)
gives None. The level's figure is slot-weighted: the sum of used slots over the samples
divided by the sum of allocated ones, so an idle moment (nothing allocated) counts for nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx

_USED, _ALLOCATED = "inferflux_kv_slots_used", "inferflux_kv_slots_allocated"


def parse_slots(text: str) -> tuple[float, float] | None:
    """(used, allocated) summed over every labelled series, or None without them."""
    sums = {_USED: 0.0, _ALLOCATED: 0.0}
    seen = False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
            seen = True
    return (sums[_USED], sums[_ALLOCATED]) if seen else None


class KVSampler:
    """Polls ``base_url``/metrics in the background between ``start()`` and ``stop()``."""

    def __init__(self, base_url: str, headers: dict[str, str], interval: float = 1.0) -> None:
        self._url = base_url.rstrip("/") + "/metrics"
        self._headers = headers
        self._interval = interval
        self._used = self._allocated = 0.0
        self._samples = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> float | None:
        """The level's slot-weighted utilisation, or None (no series, or nothing allocated)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self._used / self._allocated if self._samples and self._allocated > 0 else None

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=5.0, trust_env=False, headers=self._headers) as client:
            while True:
                try:
                    resp = await client.get(self._url, params={"name[]": [_USED, _ALLOCATED]})
                except httpx.HTTPError:
                    return
                slots = parse_slots(resp.text) if resp.status_code == 200 else None
                if slots is None:
                    return  # not an InferFlux server (or metrics off): stop asking
                if slots[1] > 0:
                    self._used += slots[0]
                    self._allocated += slots[1]
                    self._samples += 1
                await asyncio.sleep(self._interval)


def plot_levels(summary: dict[str, Any], levels: list[int], labels: dict[str, str], out_dir: Path,
                stem: str) -> list[Path]:
    """Two PNGs under ``out_dir``: generated tok/s and TTFT p50 against concurrency, one line a server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for metric, ylabel, suffix in (("output_tok_s", "generated tokens/s", "toks"),
                                   ("ttft_ms_p50", "time to first token, p50 (ms)", "ttft")):
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        for key, label in labels.items():
            points = [(c, summary[key][c][metric]) for c in levels if summary.get(key, {}).get(c, {}).get(metric)]
            if points:
                ax.plot([c for c, _ in points], [v for _, v in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        if metric == "ttft_ms_p50":
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{stem}-{suffix}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def plot_saved(results_json: Path, out_dir: Path, stem: str) -> list[Path]:
    """``plot_levels`` over a results file that ``bench_serving.py --json`` wrote."""
    import json

    doc = json.loads(results_json.read_text())
    meta = doc["meta"]
    summary = {key: {int(c): row for c, row in per_level.items()} for key, per_level in doc["summary"].items()}
    levels = sorted({c for per_level in summary.values() for c in per_level})
    labels = {key: meta.get("servers", {}).get(key, {}).get("label", key) for key in summary}
    return plot_levels(summary, levels, labels, out_dir, stem)
