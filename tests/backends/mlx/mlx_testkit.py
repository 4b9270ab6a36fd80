"""Helpers for the MLX backend tests: the CPU backend as the oracle, and greedy
decoding through the real engine. (Named uniquely: tests/ has no __init__.py files.)"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from inferflux.backends.base import ModelInfo, ModelSpec
from inferflux.backends.cpu import CPUBackend
from inferflux.backends.engine import EngineConfig, LLMEngine
from greedy_runs import run_greedy


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run torch on one thread, then restore the process's setting.

    On the shared 2-core test machine, torch's two OpenMP threads spin-wait for
    each other when other work holds a core: the CPU oracle's greedy runs took
    12.6 s of CPU time with two threads against 1.6 s with one (measured here).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cpu_oracle(spec: ModelSpec) -> tuple[CPUBackend, ModelInfo]:
    """The CPU backend on its PyTorch reference path (kernels/reference.py, the
    project's test oracle). The compiled decode kernel would cost a ~30 s build
    on a fresh machine and agrees with the reference (tests/backends/cpu)."""
    with pytest.MonkeyPatch.context() as mp, one_torch_thread():
        mp.setattr(CPUBackend, "_use_kernels", staticmethod(lambda model: "the reference path is the oracle"))
        backend = CPUBackend()
        info = backend.load(spec)
    return backend, info


def greedy(backend: Any, info: Any, tokenizer: Any, prompts: dict[str, list[int]], n: int, *, stagger: int = 0,
           **config: Any) -> dict[str, dict[str, Any]]:
    """Greedy ``n`` tokens per prompt through the engine: ``{id: {"tokens", "text"}}``.

    With ``stagger``, each prompt joins ``stagger`` steps after the previous one, so
    prefill chunks, decodes and continuations share steps."""
    config.setdefault("num_blocks", 64)
    return run_greedy(LLMEngine(backend, tokenizer, info, EngineConfig(**config)), prompts, n, stagger=stagger)
