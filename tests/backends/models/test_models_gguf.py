"""GGUF loading: config, canonical names, llama q/k un-permutation, and failures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import models_testutil as util
from inferflux.backends.models import ModelConfig, ModelLoadError, open_model
from inferflux.backends.models.gguf_loader import GGUFModel, _field_value, _open_reader, unpermute_rows
from inferflux.backends.models.layout import expected_tensors


# ----- the default model against transformers ------------------------------------------


def test_default_model_config(default_model):
    cfg = default_model.config
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == ("llama", 49152, 576, 1536)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None and cfg.context_length == 8192
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert default_model.format == "gguf"


def test_every_tensor_matches_transformers(default_model, hf_state_dict):
    """Names, shapes and values equal what transformers builds from the same GGUF, which
    proves the name mapping, the [out, in] orientation and the q/k un-permutation."""
    hf, tied = hf_state_dict
    assert tied
    seen = set()
    for name, ours in default_model.tensors():
        assert name in hf, f"{name} is not a transformers parameter"
        assert ours.dtype == np.float32 and ours.flags.c_contiguous and ours.flags.writeable
        assert ours.shape == hf[name].shape, name
        np.testing.assert_allclose(ours, hf[name], rtol=1e-6, atol=1e-6, err_msg=name)
        seen.add(name)
    # a tied model yields no lm_head: the backend reuses the embedding
    assert seen == set(hf) - {"lm_head.weight"}
    assert len(seen) == 272


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_heads, head_dim, cols in [(9, 64, 5), (3, 64, 1), (4, 8, 7)]:
        w = rng.standard_normal((n_heads * head_dim, cols)).astype(np.float32)
        permuted = util.llama_cpp_permute(w, n_heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_rows(permuted, n_heads), w)
        b = w[:, 0].copy()  # biases go through the same permutation
        np.testing.assert_array_equal(unpermute_rows(util.llama_cpp_permute(b, n_heads), n_heads), b)


# ----- synthetic files -------------------------------------------------------------------

_BASE_KV: dict[str, Any] = {
    "block_count": 2, "context_length": 128, "embedding_length": 32, "feed_forward_length": 48,
    "attention.head_count": 4, "attention.head_count_kv": 2, "rope.freq_base": 5000.0,
    "attention.layer_norm_rms_epsilon": 1e-6,
}
_VOCAB = len(util.tiny_byte_level_vocab()["tokenizer.ggml.tokens"])


def _config(arch: str, **over: Any) -> ModelConfig:
    base = dict(architecture=arch, vocab_size=_VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=float(np.float32(1e-6)), rope_theta=5000.0,
                rope_scaling=None, context_length=128, tie_word_embeddings=True, attention_bias=arch == "qwen2",
                qk_norm=arch == "qwen3", bos_token_id=1, eos_token_id=2)
    return ModelConfig(**{**base, **over})


def _tiny_gguf(tmp_path: Path, arch: str, *, kv: dict[str, Any] | None = None, config: ModelConfig | None = None,
               drop: tuple[str, ...] = (), replace: dict[str, np.ndarray] | None = None, **write: Any):
    cfg = config or _config(arch)
    required, _ = expected_tensors(cfg)
    hf = util.random_hf_tensors(required, seed=1)
    stored = dict(hf)
    if arch == "llama":  # what llama.cpp's converter does to llama q/k
        for name in stored:
            if ".q_proj." in name or ".k_proj." in name:
                stored[name] = util.llama_cpp_permute(stored[name], cfg.num_heads if ".q_proj." in name
                                                      else cfg.num_kv_heads)
    for name in drop:
        stored.pop(name)
    stored.update(replace or {})
    path = util.write_gguf(tmp_path / f"{arch}.gguf", arch, {**_BASE_KV, **(kv or {})}, stored, **write)
    return path, hf


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_synthetic_model_round_trips(tmp_path, arch):
    path, hf = _tiny_gguf(tmp_path, arch)
    src = open_model(path)
    assert src.config == _config(arch, name="")
    got = dict(src.tensors())
    assert set(got) == set(hf)
    for name, arr in hf.items():
        np.testing.assert_array_equal(got[name], arr, err_msg=name)


def test_tensors_skips_what_it_is_told_and_stored_type_names_the_blocks_type(tmp_path):
    path, hf = _tiny_gguf(tmp_path, "llama")
    src = open_model(path)
    skip = {"model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"}
    assert set(dict(src.tensors(skip=skip))) == set(hf) - skip
    for name in hf:
        stored = src.stored_blocks(name)
        assert src.stored_type(name) == (None if stored is None else stored[0]), name


def test_qwen3_explicit_head_dim(tmp_path):
    # Qwen3 heads are wider than hidden/heads: head_dim comes from attention.key_length.
    cfg = _config("qwen3", head_dim=16)
    path, hf = _tiny_gguf(tmp_path, "qwen3", config=cfg,
                          kv={"attention.key_length": 16, "attention.value_length": 16})
    src = open_model(path)
    assert src.config.head_dim == 16 and src.config.qk_norm
    assert dict(src.tensors())["model.layers.0.self_attn.q_proj.weight"].shape == (64, 32)
    assert dict(src.tensors())["model.layers.1.self_attn.k_norm.weight"].shape == (16,)


def test_quantised_llama_q_is_unpermuted(tmp_path):
    import gguf

    q = "model.layers.0.self_attn.q_proj.weight"
    path, hf = _tiny_gguf(tmp_path, "llama", quantize={q: "Q8_0"})
    got = dict(open_model(path).tensors())[q]
    # quantisation is row-wise, so it commutes with the row permutation
    want = gguf.quants.dequantize(gguf.quants.quantize(hf[q], gguf.GGMLQuantizationType.Q8_0),
                                  gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(got, want)


def test_float16_tensors_stay_float16(tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    cfg = _config("qwen2")
    required, _ = expected_tensors(cfg)
    half = util.random_hf_tensors({name: required[name]}, seed=4)[name].astype(np.float16)
    path, _ = _tiny_gguf(tmp_path, "qwen2", replace={name: half})
    got = dict(open_model(path).tensors())[name]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, half)


def test_untied_output_becomes_lm_head(tmp_path):
    rng = np.random.default_rng(2)
    head = rng.standard_normal((_VOCAB, 32)).astype(np.float32)
    path, _ = _tiny_gguf(tmp_path, "qwen2", replace={"lm_head.weight": head})
    src = open_model(path)
    assert not src.config.tie_word_embeddings
    np.testing.assert_array_equal(dict(src.tensors())["lm_head.weight"], head)


def test_rope_freqs_tensor_becomes_freq_factors(tmp_path):
    factors = np.linspace(1.0, 8.0, 4, dtype=np.float32)
    path, hf = _tiny_gguf(tmp_path, "llama", raw_tensors={"rope_freqs.weight": factors})
    src = open_model(path)
    assert src.config.rope_scaling == {"rope_type": "freq_factors", "freq_factors": tuple(factors.tolist())}
    names = {name for name, _ in src.tensors()}
    assert names == set(hf)  # rope_freqs is config, not a weight
    base = 1.0 / 5000.0 ** (np.arange(0, 8, 2) / 8)
    np.testing.assert_allclose(src.config.rope_inv_freq(), base / factors, rtol=1e-12)


def test_linear_rope_scaling(tmp_path):
    path, _ = _tiny_gguf(tmp_path, "llama", kv={"rope.scaling.type": "linear", "rope.scaling.factor": 4.0})
    assert open_model(path).config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_yarn_rope_scaling_is_refused(tmp_path):
    path, _ = _tiny_gguf(tmp_path, "qwen2", kv={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0})
    with pytest.raises(ModelLoadError, match="unsupported rope scaling 'yarn'") as e:
        open_model(path)
    assert str(path) in str(e.value)


def test_unsupported_architecture(tmp_path):
    path = util.write_gguf(tmp_path / "phi.gguf", "phi3", _BASE_KV,
                           {"model.embed_tokens.weight": np.zeros((_VOCAB, 32), np.float32)})
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'phi3'.*llama, qwen2, qwen3"):
        open_model(path)


def test_partial_rotary_is_refused(tmp_path):
    path, _ = _tiny_gguf(tmp_path, "llama", kv={"rope.dimension_count": 4})
    with pytest.raises(ModelLoadError, match="partial rotary"):
        open_model(path)


def test_missing_tensor_is_named(tmp_path):
    path, _ = _tiny_gguf(tmp_path, "llama", drop=("model.layers.1.mlp.down_proj.weight",))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.down_proj\.weight"):
        open_model(path)


def test_wrong_shape_is_named(tmp_path):
    bad = np.zeros((48, 33), np.float32)
    path, _ = _tiny_gguf(tmp_path, "llama", replace={"model.layers.0.mlp.up_proj.weight": bad})
    with pytest.raises(ModelLoadError, match=r"up_proj\.weight has shape \[48, 33\], the config implies \[48, 32\]"):
        open_model(path)


def test_unknown_tensor_is_refused(tmp_path):
    path, _ = _tiny_gguf(tmp_path, "llama", raw_tensors={"blk.0.ffn_gate_inp.weight": np.zeros((4, 32), np.float32)})
    with pytest.raises(ModelLoadError, match="unexpected tensor blk.0.ffn_gate_inp.weight"):
        open_model(path)


def test_unsupported_quant_type_fails_when_read(tmp_path):
    # down_proj rows are 256 wide here, exactly one Q2_K block (84 bytes) each
    cfg = _config("llama", intermediate_size=256)
    path, _ = _tiny_gguf(tmp_path, "llama", config=cfg, kv={"feed_forward_length": 256},
                         drop=("model.layers.0.mlp.down_proj.weight",),
                         raw_tensors={"blk.0.ffn_down.weight": np.zeros((32, 84), np.uint8)},
                         raw_types={"blk.0.ffn_down.weight": "Q2_K"})
    src = open_model(path)  # the header is fine: shapes check out
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_down\.weight.*Q2_K is not supported"):
        list(src.tensors())


# ----- bad files ---------------------------------------------------------------------------


def test_missing_path(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="does not exist") as e:
        open_model(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("content", [b"", b"hello world, not a model", b"GGUF" + b"\xff" * 60])
def test_garbage_file(tmp_path, content):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError) as e:
        open_model(path)
    assert str(path) in str(e.value)


def test_truncated_gguf(tmp_path, default_path):
    path = tmp_path / "truncated.gguf"
    with open(default_path, "rb") as f:
        path.write_bytes(f.read(200_000))  # ends inside the vocabulary
    with pytest.raises(ModelLoadError, match="cannot read GGUF file") as e:
        open_model(path)
    assert str(path) in str(e.value)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json") as e:
        open_model(tmp_path)
    assert str(tmp_path) in str(e.value)


# ----- the faster GGUFReader -------------------------------------------------------------


def test_fast_reader_reads_what_gguf_reads(tmp_path):
    """Our GGUFReader subclass must parse every metadata type and tensor exactly as gguf does."""
    import gguf

    path, _ = _tiny_gguf(tmp_path, "llama", kv={
        "general.flag": True, "general.f64": 2.5, "general.text": "héllo ✓",
        "general.ints": [1, 2, 3], "general.floats": [0.5, 1.5], "general.strs": ["a", "bé", ""],
    })
    w = gguf.GGUFWriter(str(tmp_path / "types.gguf"), "llama")
    w.add_uint8("t.u8", 200); w.add_int8("t.i8", -5); w.add_uint16("t.u16", 60000); w.add_int16("t.i16", -300)
    w.add_uint64("t.u64", 2**40); w.add_int64("t.i64", -(2**40)); w.add_float64("t.f64", 1e-300)
    w.add_int32("t.i32", -7); w.add_bool("t.b", False); w.add_string("t.s", "ok")
    w.add_array("t.arr_s", ["x", "yy", "ζ"]); w.add_array("t.arr_i", [5, -6, 7]); w.add_array("t.arr_f", [0.25, -1.0])
    w.add_tensor("x", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    for p in (path, tmp_path / "types.gguf"):
        plain, fast = gguf.GGUFReader(p), _open_reader(str(p))
        assert list(plain.fields) == list(fast.fields)
        for key, field in plain.fields.items():
            assert _field_value(fast.fields[key]) == _field_value(field), key
            assert fast.fields[key].types == field.types
        assert [(t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in fast.tensors] == \
               [(t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in plain.tensors]
        for a, b in zip(fast.tensors, plain.tensors):
            np.testing.assert_array_equal(a.data, b.data)
    assert _field_value(_open_reader(str(tmp_path / "types.gguf")).fields["t.arr_s"]) == ["x", "yy", "ζ"]


def test_closed_source_refuses_reads(tmp_path):
    path, _ = _tiny_gguf(tmp_path, "qwen2")
    src = GGUFModel(str(path))
    src.close()
    with pytest.raises(ModelLoadError, match="closed"):
        next(src.tensors())
