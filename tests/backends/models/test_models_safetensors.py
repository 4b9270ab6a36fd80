"""Hugging Face directories: tiny transformers models round-trip through our loader."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import oracles

import models_testutil as util
from tiny_checkpoints import tiny_hf_model
from inferflux.backends.models import ModelLoadError, open_model
from inferflux.backends.models.safetensors_loader import read_safetensors_header

torch = pytest.importorskip("torch")
transformers = oracles.require("transformers")


def _save_tiny(directory: Path, tokenizer, arch: str, *, dtype=None, shard: str | None = None,
               **config: Any) -> tuple[dict[str, np.ndarray], Any]:
    """A random tiny model of ``arch`` saved with save_pretrained, plus our GGUF-derived tokenizer."""
    sizes = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, max_position_embeddings=256)
    model = tiny_hf_model(arch, **{**sizes, **config})
    cfg = model.config
    if dtype is not None:
        model = model.to(dtype)
    save_kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, **save_kwargs)
    tokenizer.save(directory)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    return state, cfg


def _check_round_trip(src, state: dict[str, np.ndarray], tied: bool) -> None:
    got = dict(src.tensors())
    want = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    assert set(got) == set(want)
    for name, arr in want.items():
        assert got[name].dtype == np.float32 and got[name].flags.writeable
        np.testing.assert_array_equal(got[name], arr, err_msg=name)


@pytest.mark.parametrize("arch,extra", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 16, "tie_word_embeddings": True}),
])
def test_tiny_models_round_trip(tmp_path, our_tokenizer, arch, extra):
    state, cfg = _save_tiny(tmp_path, our_tokenizer, arch, **extra)
    src = open_model(tmp_path)
    c = src.config
    assert src.format == "safetensors"
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == \
        (arch, 49152, 32, 64, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, extra.get("head_dim", 8))
    assert c.rms_norm_eps == 1e-5 and c.context_length == 256
    assert c.rope_theta == cfg.rope_parameters["rope_theta"] and c.rope_scaling is None
    assert c.tie_word_embeddings == extra.get("tie_word_embeddings", False)
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)
    _check_round_trip(src, state, c.tie_word_embeddings)


def test_bfloat16_widens_exactly(tmp_path, our_tokenizer):
    state, _ = _save_tiny(tmp_path, our_tokenizer, "qwen2", dtype=torch.bfloat16)
    header, _ = read_safetensors_header(str(tmp_path / "model.safetensors"))
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    _check_round_trip(open_model(tmp_path), state, tied=False)


def test_float16_stays_float16(tmp_path, our_tokenizer):
    state, _ = _save_tiny(tmp_path, our_tokenizer, "llama", dtype=torch.float16)
    got = dict(open_model(tmp_path).tensors())
    assert {a.dtype for a in got.values()} == {np.dtype(np.float16)}
    np.testing.assert_array_equal(got["model.layers.1.mlp.up_proj.weight"], state["model.layers.1.mlp.up_proj.weight"])


def test_sharded_checkpoint(tmp_path, our_tokenizer):
    state, _ = _save_tiny(tmp_path, our_tokenizer, "llama", shard="1MB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _check_round_trip(open_model(tmp_path), state, tied=False)


def test_tokenizer_from_directory_matches_gguf(tmp_path, our_tokenizer):
    _save_tiny(tmp_path, our_tokenizer, "llama")
    tok = open_model(tmp_path).tokenizer()
    for text in util.TEXTS:
        assert tok.encode(text) == our_tokenizer.encode(text), text
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == \
        (our_tokenizer.bos_token_id, our_tokenizer.eos_token_id, our_tokenizer.eos_token_ids)
    assert tok.add_bos_token == our_tokenizer.add_bos_token and tok.vocab_size == our_tokenizer.vocab_size
    conversation = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(conversation) == our_tokenizer.apply_chat_template(conversation)


def test_tokenizer_config_add_bos_is_honoured(tmp_path, our_tokenizer):
    _save_tiny(tmp_path, our_tokenizer, "llama")
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = True
    cfg["chat_template"] = [{"name": "default", "template": "{{ bos_token }}named"}]
    cfg_path.write_text(json.dumps(cfg))
    tok = open_model(tmp_path).tokenizer()
    assert tok.add_bos_token and tok.encode("hi") == [1] + our_tokenizer.encode("hi")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>named"


def test_eos_list_from_generation_config(tmp_path, our_tokenizer):
    _save_tiny(tmp_path, our_tokenizer, "llama")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert open_model(tmp_path).tokenizer().eos_token_ids == frozenset({0, 2, 5})


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


@pytest.fixture
def tiny_dir(tmp_path, our_tokenizer) -> Path:
    _save_tiny(tmp_path, our_tokenizer, "llama")
    return tmp_path


@pytest.mark.parametrize("rope,want", [
    ({"rope_parameters": None, "rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
     (1234.0, {"rope_type": "linear", "factor": 2.0})),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 128}},
     (5e5, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128})),
    ({"rope_parameters": None, "rope_theta": None}, (10000.0, None)),
])
def test_rope_config_forms(tiny_dir, rope, want):
    _edit_config(tiny_dir, **rope)
    c = open_model(tiny_dir).config
    assert (c.rope_theta, c.rope_scaling) == want


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "gpt2"}, "unsupported model architecture 'gpt2'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "unsupported rope scaling 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"use_sliding_window": True}, "sliding-window attention is not supported"),
    ({"num_hidden_layers": None}, "config.json is missing num_hidden_layers"),
    ({"num_hidden_layers": 3}, "missing 9 tensor"),
    ({"hidden_size": "wide"}, "config.json has a bad value"),
])
def test_bad_configs(tiny_dir, changes, message):
    _edit_config(tiny_dir, **changes)
    with pytest.raises(ModelLoadError, match=message) as e:
        open_model(tiny_dir)
    assert str(tiny_dir) in str(e.value)


def test_bad_config_json(tiny_dir):
    (tiny_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        open_model(tiny_dir)


def test_missing_weights(tiny_dir):
    os.remove(tiny_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        open_model(tiny_dir)


def test_garbage_weights(tiny_dir):
    (tiny_dir / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a readable safetensors file") as e:
        open_model(tiny_dir)
    assert "model.safetensors" in str(e.value)


def test_unsupported_dtype(tiny_dir):
    tensors = dict(open_model(tiny_dir).tensors())
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float64)
    util.write_safetensors(tiny_dir / "model.safetensors", tensors)
    with pytest.raises(ModelLoadError, match="model.norm.weight has dtype F64"):
        open_model(tiny_dir)


def test_tied_checkpoint_with_stored_head(tmp_path, our_tokenizer):
    # some tied checkpoints store lm_head.weight anyway; the contract is: no lm_head when tied
    state, _ = _save_tiny(tmp_path, our_tokenizer, "llama", tie_word_embeddings=True)
    util.write_safetensors(tmp_path / "model.safetensors",
                           {**{k: v for k, v in state.items()}, "lm_head.weight": state["model.embed_tokens.weight"]})
    _check_round_trip(open_model(tmp_path), state, tied=True)


def test_truncated_weights(tiny_dir):
    path = tiny_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    src = open_model(tiny_dir)  # headers are fine; the data runs out
    with pytest.raises(ModelLoadError, match="truncated"):
        list(src.tensors())


def test_missing_tokenizer(tiny_dir):
    os.remove(tiny_dir / "tokenizer.json")
    src = open_model(tiny_dir)
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        src.tokenizer()
