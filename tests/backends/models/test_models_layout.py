"""backends/models/layout.py, the one statement of which weights a config implies: against
what transformers saves for every variant, and its refusals (at open time and while
streaming)."""

from __future__ import annotations

import numpy as np
import pytest
import oracles
from tiny_checkpoints import VARIANTS, write_variant

import models_testutil as util
from inferflux.backends.models import ModelLoadError, open_model
from inferflux.backends.models.layout import assemble, destinations, expected_tensors
from inferflux.backends.models.safetensors_loader import read_safetensors_header

oracles.require("transformers")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_layout_is_what_transformers_saves(tmp_path, variant):
    """Every required tensor, and only layout tensors, with the layout's shapes; the
    bias variants carry the optional biases their architecture gives them."""
    write_variant(tmp_path, variant)
    header, _ = read_safetensors_header(str(tmp_path / "model.safetensors"))
    saved = {name: tuple(info["shape"]) for name, info in header.items()}
    required, optional = expected_tensors(open_model(tmp_path).config)
    assert {name: saved.get(name) for name in required} == required
    extra = saved.keys() - required.keys()
    assert {name: saved[name] for name in extra} == {name: optional.get(name) for name in extra}
    has = {name.split(".", 3)[3] for name in extra}
    want = {"llama-biases": {"self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"},
            "qwen3-biases": {"self_attn.o_proj.bias"}}.get(variant, set())
    assert has == want


def test_destinations_cover_every_tensor_once(tmp_path):
    cfg = open_model(write_variant(tmp_path, "llama-biases")).config
    dests = destinations(cfg)
    names = [name for d in dests for name in d.names]
    assert len(names) == len(set(names))
    assert set(names) == set().union(*expected_tensors(cfg))
    assert len({(d.layer, d.role) for d in dests}) == len(dests)
    qkv = next(d for d in dests if d.role == "qkv" and d.layer == 1)
    assert qkv.names == tuple(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv")
    assert qkv.shape == ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size)


def test_assemble_fuses_parts_in_order_and_names_what_is_wrong(tmp_path):
    src = open_model(write_variant(tmp_path, "qwen2"))
    tensors = dict(src.tensors())
    fused = {(d.layer, d.role): array for d, array in assemble(src.config, tensors.items())}
    p = "model.layers.0."
    np.testing.assert_array_equal(fused[(0, "qkv_bias")], np.concatenate(
        [tensors[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]))
    np.testing.assert_array_equal(fused[(0, "gate_up")], np.concatenate(
        [tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]]))
    cases = {
        "unexpected tensor in model file: model.layers.0.mlp.extra.weight":
            [*tensors.items(), ("model.layers.0.mlp.extra.weight", tensors["model.norm.weight"])],
        "model.norm.weight appears twice": [*tensors.items(), ("model.norm.weight", tensors["model.norm.weight"])],
        r"model.norm.weight: shape \(3,\) != expected \(64,\)":
            {**tensors, "model.norm.weight": np.zeros(3, np.float32)}.items(),
        r"lacks tensors: \['model.layers.1.self_attn.k_proj.bias'\]":
            [t for t in tensors.items() if t[0] != "model.layers.1.self_attn.k_proj.bias"],
        r"lacks tensors: \['model.layers.0.mlp.up_proj.bias'\]":
            [*tensors.items(), (p + "mlp.gate_proj.bias", np.zeros(96, np.float32))],
    }
    for message, stream in cases.items():
        with pytest.raises(ValueError, match=message):
            list(assemble(src.config, stream))


def test_assemble_takes_tensors_left_out_on_purpose_as_held_elsewhere(tmp_path):
    """``absent`` (the tensors a backend keeps as the file's blocks): not missing when left out, refused if
    they come anyway, and the destinations they make up are not yielded."""
    src = open_model(write_variant(tmp_path, "qwen2"))
    gate_up = ("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight")
    fused = {(d.layer, d.role) for d, _ in assemble(src.config, src.tensors(skip=gate_up), gate_up)}
    assert (1, "gate_up") not in fused and (0, "gate_up") in fused and (1, "qkv") in fused
    with pytest.raises(ValueError, match="lacks tensors: .'model.layers.1.mlp.up_proj.weight'"):
        list(assemble(src.config, src.tensors(skip=gate_up), gate_up[:1]))
    with pytest.raises(ValueError, match="unexpected tensor in model file: model.layers.1.mlp.gate_proj.weight"):
        list(assemble(src.config, src.tensors(), gate_up))


def test_a_partial_set_of_optional_biases_is_refused_at_open_time(tmp_path):
    src = open_model(write_variant(tmp_path, "llama-biases"))
    tensors = {name: array for name, array in src.tensors() if name != "model.layers.1.mlp.up_proj.bias"}
    util.write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.gate_proj.bias comes without "
                                             "model.layers.1.mlp.up_proj.bias; these biases go together"):
        open_model(tmp_path)
