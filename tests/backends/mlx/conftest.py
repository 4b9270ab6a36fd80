"""The default model (SmolLM2-135M GGUF) loaded once in float32 on the MLX backend
and on the CPU backend, its oracle."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from inferflux.backends.base import ModelSpec
from inferflux.backends.models import default_model_path, open_model

from mlx_testkit import cpu_oracle, one_torch_thread


@pytest.fixture(scope="session")
def smol_spec() -> ModelSpec:
    return ModelSpec(name="smollm2", path=default_model_path(), dtype="float32")


@pytest.fixture(scope="session")
def smol_tokenizer() -> Any:
    return open_model(default_model_path()).tokenizer()


@pytest.fixture(scope="session")
def mlx_loaded(smol_spec: ModelSpec) -> tuple[Any, Any]:
    from inferflux.backends.mlx import MLXBackend

    backend = MLXBackend()
    return backend, backend.load(smol_spec)


@pytest.fixture(scope="session")
def cpu_loaded(smol_spec: ModelSpec) -> tuple[Any, Any]:
    return cpu_oracle(smol_spec)


@pytest.fixture(autouse=True)
def _torch_on_one_thread() -> Iterator[None]:
    """The CPU oracle runs on one thread in these tests (mlx_testkit.one_torch_thread)."""
    with one_torch_thread():
        yield
