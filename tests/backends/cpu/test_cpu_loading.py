"""Weight loading into the CPU model: every parameter filled, nothing silently ignored."""

from __future__ import annotations

import sys

import pytest
import torch

from backends.base import BackendError, ModelSpec
from backends.cpu import CPUBackend
from backends.cpu.model import Transformer
from backends.models import default_model_path, open_model


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
    tensors.append(("model.layers.0.mlp.down_proj.bias", tensors[1][1]))
    with pytest.raises(ValueError, match="unexpected tensor.*down_proj.bias"):
        _empty_model(source).load_weights(tensors)


def test_a_bad_dtype_is_a_backend_error():
    with pytest.raises(BackendError, match="unsupported dtype"):
        CPUBackend().load(ModelSpec(name="m", path=default_model_path(), dtype="float8"))


@pytest.mark.skipif(sys.platform != "linux", reason="PyTorch's Linux wheels use libgomp; other platforms differ")
def test_release_openmp_pool_frees_the_callers_team():
    # A thread that ran a parallel region holds a libgomp team; releasing it
    # must succeed (the engine thread depends on it for full speed) and torch
    # must keep working on this thread afterwards (a new team is made on demand).
    import torch

    from backends.cpu.backend import release_openmp_pool

    a = torch.randn(64, 256)
    expected = a @ a.T
    assert release_openmp_pool() is True
    assert torch.equal(a @ a.T, expected)
