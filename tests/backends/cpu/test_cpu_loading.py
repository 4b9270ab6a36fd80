"""Weight loading into the CPU model: every parameter filled, nothing silently ignored."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from inferflux.backends.base import BackendError, ModelSpec
from inferflux.backends.cpu import CPUBackend
from inferflux.backends.cpu.model import Transformer
from inferflux.backends.models import default_model_path, open_model

# These load the default model's weights (the tiers: tests/conftest.py).
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def source():
    return open_model(default_model_path())


def _empty_model(source) -> Transformer:
    with torch.device("meta"):
        model = Transformer(source.config, torch.float32)
    return model.to_empty(device="cpu")


def test_fused_projections_hold_their_parts_in_order(source):
    tensors = dict(source.tensors())
    model = _empty_model(source)
    model.load_weights(tensors.items())
    layer = model.layers[2]
    q = tensors["model.layers.2.self_attn.q_proj.weight"]
    v = tensors["model.layers.2.self_attn.v_proj.weight"]
    up = tensors["model.layers.2.mlp.up_proj.weight"]
    assert torch.equal(layer.attn.qkv.weight[: q.shape[0]], torch.from_numpy(q))
    assert torch.equal(layer.attn.qkv.weight[-v.shape[0]:], torch.from_numpy(v))
    assert torch.equal(layer.mlp.gate_up.weight[-up.shape[0]:], torch.from_numpy(up))


def test_a_missing_tensor_is_named(source):
    tensors = [t for t in source.tensors() if t[0] != "model.layers.3.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="lacks tensors.*layers.3.mlp"):
        _empty_model(source).load_weights(tensors)


def test_an_unexpected_tensor_is_refused(source):
    tensors = list(source.tensors())
    tensors.append(("model.layers.0.mlp.extra_proj.weight", tensors[1][1]))
    with pytest.raises(ValueError, match="unexpected tensor.*extra_proj.weight"):
        _empty_model(source).load_weights(tensors)


def test_a_misshapen_optional_bias_is_refused(source):
    tensors = [*source.tensors(), ("model.layers.0.mlp.down_proj.bias", np.zeros(3, dtype=np.float32))]
    with pytest.raises(ValueError, match=r"down_proj.bias: shape \(3,\) != expected \(576,\)"):
        _empty_model(source).load_weights(tensors)


def test_optional_biases_are_added_and_shared_by_a_self_draft(source):
    """An optional bias a checkpoint has becomes the projection's bias (the forward adds
    it); one it lacks stays None. A truncated copy shares every weight, biases included."""
    bias = np.arange(576, dtype=np.float32)
    model = _empty_model(source)
    model.load_weights([*source.tensors(), ("model.layers.1.self_attn.o_proj.bias", bias)])
    assert torch.equal(model.layers[1].attn.o_proj.bias, torch.from_numpy(bias))
    assert model.layers[0].attn.o_proj.bias is None and model.layers[1].mlp.down.bias is None
    draft = model.truncated(2)
    assert len(draft.layers) == 2
    assert draft.layers[1].attn.o_proj.bias is model.layers[1].attn.o_proj.bias
    shared = {id(p) for p in model.parameters()}
    assert all(id(p) in shared for p in draft.parameters())


def test_a_bad_dtype_is_a_backend_error():
    with pytest.raises(BackendError, match="unsupported dtype"):
        CPUBackend().load(ModelSpec(name="m", path=default_model_path(), dtype="float8"))


@pytest.mark.skipif(sys.platform != "linux", reason="PyTorch's Linux wheels use libgomp; other platforms differ")
def test_release_openmp_pool_frees_the_callers_team():
    # A thread that ran a parallel region holds a libgomp team; releasing it
    # must succeed (the engine thread depends on it for full speed) and torch
    # must keep working on this thread afterwards (a new team is made on demand).
    import torch

    from inferflux.backends.cpu.runtime import release_openmp_pool

    a = torch.randn(64, 256)
    expected = a @ a.T
    assert release_openmp_pool() is True
    assert torch.equal(a @ a.T, expected)
