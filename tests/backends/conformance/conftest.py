"""The backend conformance suite: one set of tests for every backend the registry finds.

Tests that take a ``backend_name`` argument run once per backend registered under
the ``inferflux.backends`` entry-point group (built-in or third-party). A backend
whose probe fails here, or that INFERFLUX_BACKENDS_ALLOWED blocks, shows up as a
skip carrying the probe's reason. Select one backend with ``-k NAME``.

The oracle is the CPU backend in float32, run the plainest way: one sequence at a
time, no engine, the PyTorch reference attention (``kernels/reference.py``), so the
cpu backend's engine path (C++ decode kernel, batching, chunked prefill) is
checked against something other than itself. The CPU backend's float32 greedy
output equals transformers' token for token (tests/backends/cpu/test_cpu_reference.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
from conformance_kit import BLOCK, MAX_TOKENS, greedy_direct
from greedy_runs import reference_prompts, run_greedy

from inferflux.backends import registry
from inferflux.backends.base import ModelInfo, ModelSpec
from inferflux.backends.models import default_model_path, open_model


# Backends that compute no model, so have nothing to conform: the stand-in device, a measuring
# tool for the host loop (docs/backends.md), tested in tests/backends/standin/.
NOT_MODELS = frozenset({"standin"})


@functools.cache
def _backend_params() -> list[Any]:
    """One param per installed backend; those that cannot run here are skips saying why."""
    installed = set(registry.backend_names())
    params = []
    for status in registry.statuses():
        if status.name not in installed:  # a name in the priority chain that nothing registers
            continue
        if status.kind == "remote":  # serves whole requests from upstream servers: no forward to conform
            continue
        if status.name in NOT_MODELS:
            continue
        marks = () if status.available else (pytest.mark.skip(reason=f"{status.name} backend: {status.reason}"),)
        params.append(pytest.param(status.name, marks=marks, id=status.name))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_name" in metafunc.fixturenames:
        # Session scope: each backend loads the model once, and pytest runs one
        # backend's tests together.
        metafunc.parametrize("backend_name", _backend_params(), scope="session")


@pytest.fixture(scope="session")
def loaded(backend_name: str) -> tuple[Any, ModelInfo]:
    """The backend under test with the default model in float32."""
    cls = registry.get_backend(backend_name)
    backend = cls()
    info = backend.load(ModelSpec(name="smollm2", path=default_model_path(), dtype="float32"))
    assert info.dtype == "float32", f"{backend_name} loaded {info.dtype} when float32 was asked for"
    return backend, info


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return open_model(default_model_path()).tokenizer()


@pytest.fixture(scope="session")
def prompts(tokenizer: Any) -> list[list[int]]:
    return reference_prompts(tokenizer)


@pytest.fixture(scope="session")
def oracle_tokens(prompts: list[list[int]]) -> list[list[int]]:
    """The CPU backend's float32 greedy tokens for each prompt, the plain way (see the module docstring)."""
    from inferflux.backends.cpu import CPUBackend
    from inferflux.kernels import reference

    oracle = CPUBackend()
    oracle.load(ModelSpec(name="oracle", path=default_model_path(), dtype="float32"))
    oracle.model.use_paged_attention(reference.paged_attention)
    return [greedy_direct(oracle, ids, MAX_TOKENS) for ids in prompts]


RunEngine = Callable[..., dict[str, list[int]]]


@pytest.fixture
def run_engine(loaded: tuple[Any, ModelInfo], tokenizer: Any) -> RunEngine:
    """``run_engine(requests, n, stagger=0, **EngineConfig)``: greedy tokens per request id.

    With ``stagger`` each request joins ``stagger`` steps after the previous one.
    Checks that a drained engine holds no blocks; ``run_engine.last`` is the engine.
    """
    from inferflux.backends.engine import EngineConfig, LLMEngine

    backend, info = loaded

    def run(requests: dict[str, list[int]], n: int = MAX_TOKENS, *, stagger: int = 0, **config: Any):
        if "kv_cache_bytes" not in config:
            config.setdefault("num_blocks", 64)  # plenty for four prompts; the 1 GiB default only costs time
        engine = LLMEngine(backend, tokenizer, info, EngineConfig(block_size=BLOCK, **config))
        run.last = engine  # type: ignore[attr-defined]
        return {rid: r["tokens"] for rid, r in run_greedy(engine, requests, n, stagger=stagger).items()}

    return run
