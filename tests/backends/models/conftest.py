"""Session-wide fixtures: the default model and the transformers oracles are costly to load."""

from __future__ import annotations

import os

import pytest
import oracles

import hf_oracle
from inferflux.backends.models import default_model_path, open_model


@pytest.fixture(scope="session")
def default_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def default_model(default_path):
    return open_model(default_path)


@pytest.fixture(scope="session")
def our_tokenizer(default_model):
    return default_model.tokenizer()


@pytest.fixture(scope="session")
def hf_tokenizer(default_path):
    transformers = oracles.require("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(default_path), gguf_file=os.path.basename(default_path)
    )


@pytest.fixture(scope="session")
def hf_state_dict(hf_oracle_dir):
    """The state dict transformers builds from the same GGUF (float32 numpy arrays; ``hf_oracle``)."""
    pytest.importorskip("torch")
    oracles.require("transformers")
    model = hf_oracle.causal_lm(hf_oracle_dir)
    state = {name: t.detach().numpy().copy() for name, t in model.state_dict().items()}
    tied = model.config.tie_word_embeddings
    del model
    return state, tied
