"""The independent oracle: Hugging Face transformers loading the same GGUF file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import hf_oracle


@pytest.fixture(scope="session")
def hf_causal_lm(hf_oracle_dir: Path) -> Any:
    """transformers' float32 model built from the default GGUF (costly: once per run, ``hf_oracle``)."""
    return hf_oracle.causal_lm(hf_oracle_dir)
