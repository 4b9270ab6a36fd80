"""Every backend against transformers on every supported architecture and variant.

The other conformance tests run one model (SmolLM2, a llama) against the CPU backend;
here each backend loads tiny random checkpoints that transformers wrote (llama, tied and
untied heads, Llama 3 rope scaling, the optional o_proj and MLP biases, qwen2's q/k/v
biases, qwen3's q/k norms and wide heads: tests/support/tiny_checkpoints.py) and its
float32 logits over prefills, a continuation and decode steps must be transformers' own,
so a mistake the backends share cannot pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import oracles
from tiny_checkpoints import VARIANTS, mixed_steps, reference_logits, run_steps, write_variant

from inferflux.backends import registry
from inferflux.backends.base import ModelSpec

oracles.require("transformers")

# Float32 against float32, summed in other orders: measured differences stay near 1e-6.
ATOL = 1e-4


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float32_logits_equal_transformers(backend_name, variant, tmp_path):
    path = write_variant(tmp_path, variant)
    backend = registry.get_backend(backend_name)()
    info = backend.load(ModelSpec(variant, str(path), dtype="float32"))
    assert info.dtype == "float32"
    steps = mixed_steps()
    for i, (got, want) in enumerate(zip(run_steps(backend, steps), reference_logits(path, steps), strict=True)):
        assert got.shape == want.shape, f"step {i}"
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=f"{variant}, step {i}")
