"""Fixtures shared by the gateway tests beyond the session's (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hf_oracle
from streams import SEATS


@pytest.fixture(scope="session")
def small_batch_model() -> Iterator[Any]:
    """The default model with a batch of ``SEATS`` sequences, for tests where a flood must queue."""
    from inferflux.backends.base import ModelSpec
    from inferflux.backends.engine import EngineConfig
    from inferflux.backends.models import default_model_path

    from inferflux.gateway.models.served import load_served_model
    from inferflux.gateway.settings import DEFAULT_MODEL_NAME

    spec = ModelSpec(name=DEFAULT_MODEL_NAME, path=default_model_path(), dtype="float32")
    model = load_served_model(spec, "cpu", EngineConfig(kv_cache_bytes=32 * 1024 * 1024, max_num_seqs=SEATS))
    yield model
    model.shutdown()


@pytest.fixture(scope="session")
def hf_smollm2(hf_oracle_dir: Path) -> Any:
    """transformers' float32 copy of the default model, from the same GGUF (the oracle; costly: ``hf_oracle``)."""
    return hf_oracle.causal_lm(hf_oracle_dir)


@pytest.fixture(scope="module")
def fleet_model() -> Iterator[Any]:
    """A model served by an upstream that does not exist (``upstream.invalid``): planning needs no connection."""
    from inferflux.backends.base import ModelSpec

    from inferflux.gateway.models.served import load_served_model

    spec = ModelSpec(name="fleet", path="", upstream={"endpoints": ["http://upstream.invalid/v1"], "model": "up"})
    model = load_served_model(spec, "openai")  # nothing connects until a request streams
    yield model
    model.shutdown()
