"""The MLX backend on tiny random Hugging Face checkpoints (tests/support/tiny_checkpoints.py):
bfloat16 loading and swapping, and RoPE against kernels.reference. Its float32 logits on
every supported architecture and variant are checked against transformers with the
other backends' in tests/backends/conformance/test_conformance_architectures.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_checkpoints import BLOCK, mixed_steps, reference_logits, run_steps, write_variant

from inferflux.backends.base import ModelSpec
from inferflux.backends.mlx import MLXBackend
from inferflux.backends.models import open_model
from inferflux.kernels import reference

# Skipped, saying why, only where mlx is absent (it is a dev dependency on Linux and macOS).
mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'inferflux[mlx]')")
from inferflux.backends.mlx.model import Transformer  # noqa: E402


def test_bfloat16_loads_runs_and_swaps(tmp_path):
    path = write_variant(tmp_path, "qwen3")  # 1 KV head of 32
    backend = MLXBackend()
    info = backend.load(ModelSpec("tiny", str(path), dtype="bfloat16"))
    assert info.dtype == "bfloat16" and backend.kv_caches == []
    assert backend.kv_block_bytes(BLOCK) == 2 * 2 * BLOCK * 1 * 32 * 2
    steps = mixed_steps()
    got = run_steps(backend, steps)
    want = reference_logits(path, steps)
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


def test_rope_is_the_half_split_convention(tmp_path):
    """mx.fast.rope with ``traditional=False`` rotates ``rotate_half`` pairs, the layout
    our loaders produce (GGUF llama q/k rows are un-permuted); ``traditional=True`` is
    the adjacent-pair form that the permuted GGUF layout would need."""
    cfg = open_model(write_variant(tmp_path, "llama3-scaled")).config
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
