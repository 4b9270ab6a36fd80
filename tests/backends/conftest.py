"""The independent oracle: Hugging Face transformers loading the same GGUF file."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def hf_causal_lm():
    """transformers' float32 model built from the default GGUF (costly: load once)."""
    import torch
    import transformers

    from backends.models import default_model_path

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()
