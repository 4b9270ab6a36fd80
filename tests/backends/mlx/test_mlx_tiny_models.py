"""The MLX backend on tiny random Hugging Face checkpoints of every supported shape
(qwen2's q/k/v biases, qwen3's q/k norms and wide heads, llama3 rope scaling, tied
and untied heads), against the CPU backend loading the same files; RoPE against
kernels.reference; bfloat16 loading and swapping.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from backends.base import Batch, BackendError, ModelSpec, SequenceSlice
from backends.mlx import MLXBackend
from backends.models import ModelConfig, open_model
from backends.models.layout import expected_tensors
from kernels import reference

from mlx_testkit import cpu_oracle

# Skipped, saying why, only where mlx is absent (it is a dev dependency on Linux and macOS).
mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'inferflux[mlx]')")
from backends.mlx.model import Transformer  # noqa: E402

BLOCK = 4
VOCAB = 96


def tiny_config(architecture: str, **changes) -> ModelConfig:
    base = dict(
        architecture=architecture, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        context_length=512, tie_word_embeddings=True, attention_bias=architecture == "qwen2",
        qk_norm=architecture == "qwen3",
    )
    return ModelConfig(**{**base, **changes})


CONFIGS = {
    "qwen2": tiny_config("qwen2", tie_word_embeddings=False),
    "qwen3": tiny_config("qwen3", num_kv_heads=1, head_dim=32),  # head_dim != hidden / heads
    "llama3-scaled": tiny_config("llama", num_kv_heads=4, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
}


def write_tiny_model(directory: Path, cfg: ModelConfig) -> Path:
    """A Hugging Face directory (config.json, model.safetensors) of random weights."""
    config = {
        "model_type": cfg.architecture, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.context_length, "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
    }
    (directory / "config.json").write_text(json.dumps(config))
    required, _ = expected_tensors(cfg)
    rng = np.random.default_rng(cfg.num_kv_heads * cfg.head_dim)
    tensors = {}
    for name, shape in required.items():
        if name.endswith("norm.weight"):
            tensors[name] = (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:  # keep activations O(1) through the layers
            tensors[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    loaded = open_model(directory).config
    if dataclasses.replace(loaded, name="") != cfg:
        raise AssertionError(f"the written config reads back differently: {loaded}")
    return directory


def _steps() -> list[list[SequenceSlice]]:
    """Fresh prefills, a continuation chunk with a logits row per token (speculative
    verification), decode rows, and a 70-token sequence (past the scaled llama3
    model's original context of 32)."""
    rng = np.random.default_rng(1)
    a, b, c, d = (rng.integers(0, VOCAB, n).tolist() for n in (9, 11, 3, 70))
    tables = {0: [0, 1, 2], 1: [5, 3, 4], 2: [6], 3: list(range(7, 26))}
    return [
        [SequenceSlice(0, a, 0, tables[0], 9), SequenceSlice(1, b[:5], 0, tables[1], 0),
         SequenceSlice(3, d, 0, tables[3], 1)],
        [SequenceSlice(1, b[5:], 5, tables[1], 6), SequenceSlice(0, [7], 9, tables[0], 1),
         SequenceSlice(2, c, 0, tables[2], 3), SequenceSlice(3, [5, 6], 70, tables[3], 2)],
        [SequenceSlice(3, [1], 72, tables[3], 1), SequenceSlice(2, [8], 3, tables[2], 1)],
    ]


def _run(backend, steps) -> list[np.ndarray]:
    backend.allocate_kv(32, BLOCK)
    return [np.asarray(backend.forward(Batch(step, BLOCK))) for step in steps]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_models_match_the_cpu_backend(name, tmp_path):
    path = write_tiny_model(tmp_path, CONFIGS[name])
    spec = ModelSpec(name, str(path), dtype="float32")
    mlx_backend = MLXBackend()
    info = mlx_backend.load(spec)
    cpu_backend, cpu_info = cpu_oracle(spec)
    assert info == cpu_info
    steps = _steps()
    for got, want in zip(_run(mlx_backend, steps), _run(cpu_backend, steps), strict=True):
        assert got.shape == want.shape and got.shape[1] == VOCAB
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_bfloat16_loads_runs_and_swaps(tmp_path):
    path = write_tiny_model(tmp_path, CONFIGS["qwen3"])
    backend = MLXBackend()
    info = backend.load(ModelSpec("tiny", str(path), dtype="bfloat16"))
    assert info.dtype == "bfloat16" and backend.kv_caches == []
    assert backend.kv_block_bytes(BLOCK) == 2 * 2 * BLOCK * 1 * 32 * 2
    steps = _steps()
    got = _run(backend, steps)
    want = _run(cpu_oracle(ModelSpec("tiny", str(path), dtype="float32"))[0], steps)
    # bf16 keeps ~3 significant digits: against float32 the logits (magnitudes up to
    # ~3.6) were off by at most 0.07 when measured.
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=0.2, rtol=0)
    assert backend.kv_caches[0][0].dtype == mx.bfloat16
    saved = np.array(backend.kv_caches[1][1][:, [0, 1]].astype(mx.float32))
    backend.allocate_swap(2, BLOCK, str(tmp_path))
    backend.swap_out([(0, 1), (1, 0)])
    backend.allocate_kv(32, BLOCK)
    backend.swap_in([(1, 4), (0, 2)])
    np.testing.assert_array_equal(np.array(backend.kv_caches[1][1][:, [4, 2]].astype(mx.float32)), saved)


def test_rope_is_the_half_split_convention():
    """mx.fast.rope with ``traditional=False`` rotates ``rotate_half`` pairs, the layout
    our loaders produce (GGUF llama q/k rows are un-permuted); ``traditional=True`` is
    the adjacent-pair form that the permuted GGUF layout would need."""
    cfg = CONFIGS["llama3-scaled"]
    model = Transformer(cfg, mx.float32)
    positions = np.array([0, 1, 17, 300, 2047])
    x = np.random.default_rng(0).standard_normal((len(positions), 3, cfg.head_dim)).astype(np.float32)
    cos, sin = reference.rope_cos_sin(torch.from_numpy(positions), torch.from_numpy(cfg.rope_inv_freq()),
                                      torch.float32)
    ours = np.array(model._rope(mx.array(x), mx.array(positions.astype(np.int32))))
    np.testing.assert_allclose(ours, reference.apply_rope(torch.from_numpy(x), cos, sin).numpy(), atol=2e-4)
    adjacent = mx.fast.rope(mx.array(x)[:, :, None], cfg.head_dim, traditional=True, base=None, scale=1.0,
                            offset=mx.array(positions), freqs=model.rope_periods)[:, :, 0]
    interleaved = reference.apply_rope_interleaved(torch.from_numpy(x), cos, sin).numpy()
    np.testing.assert_allclose(np.array(adjacent), interleaved, atol=2e-4)
    assert np.abs(ours - interleaved).max() > 0.1


def test_probe_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlx" else real(name, *a))
    assert MLXBackend.probe() == "MLX is not installed (pip install 'inferflux[mlx]')"


def test_a_checkpoint_with_unsupported_biases_is_refused(tmp_path):
    path = write_tiny_model(tmp_path, CONFIGS["qwen2"])
    tensors = dict(open_model(path).tensors())
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, dtype=np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(BackendError, match="o_proj.bias is not supported by the mlx backend"):
        MLXBackend().load(ModelSpec("tiny", str(path)))
