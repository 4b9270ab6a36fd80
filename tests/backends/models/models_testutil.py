"""Helpers shared by the backends/models tests: synthetic GGUF files and tiny vocabularies."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from inferflux.backends.models.gguf_tokenizer import bytes_to_unicode

# A varied text set for tokenizer comparisons; the last one uses bytes SmolLM2 cannot encode.
TEXTS = [
    "",
    " ",
    "Hello, world!",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n\n\n",
    "multiple     spaces    inside\u00a0nbsp\u2009thin\u200bzero-width",
    "numbers 7 42 12345 3.14159 1,000,000 9999999999999999 0x1F 1e-9",
    "superscripts ¹²³ fractions ½ roman Ⅷ arabic-indic ١٢٣",
    "日本語のテキストと中文文本。한국어 텍스트",
    "emoji 😀👍🏽👨‍👩‍👧 flags 🇫🇷 ok",
    "café naïve résumé Ångström Ελληνικά Кириллица",
    "مرحبا بالعالم — שלום עולם",
    "def f(x):\n\treturn x ** 2  # square\n\nclass A:\n    def g(self):\n        pass\n",
    "if (a && b) { return a[i] != b->c; } // done",
    "I'm you're they'll we've he'd IT'S",
    "ALL CAPS and MiXeD 123abc456",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>end",
    "not special: <|im_start| and <im_end|> and <|unknown|>",
    "<jupyter_code>x = 1<jupyter_output>",
    "a" * 300 + " " + "ab" * 100,
    "bytes missing from the vocabulary: \x04 \x13 \U00040000 are dropped",
]

# HF name pieces -> GGUF name pieces, written out independently of the loader's table.
_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF half-split rows -> GGML interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_byte_level_vocab() -> dict[str, Any]:
    """A byte-level BPE vocabulary: the 256 byte symbols, a few merges, two control tokens."""
    symbols = list(bytes_to_unicode().values())
    merged = ["Ġt", "he", "Ġthe", "in", "Ġin"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *symbols, *merged]
    types = [3, 3, 3] + [1] * (len(symbols) + len(merged))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he", "i n", "Ġ in"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def random_hf_tensors(shapes: Mapping[str, tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_gguf(
    path: Path,
    arch: str,
    kv: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    raw_tensors: Mapping[str, np.ndarray] | None = None,
    tokenizer: Mapping[str, Any] | None = None,
    quantize: Mapping[str, str] | None = None,
    raw_types: Mapping[str, str] | None = None,
) -> Path:
    """Write a GGUF. ``kv`` keys without a dot get the ``{arch}.`` prefix; ``tensors`` are HF
    names (renamed here, stored as given, or quantised per ``quantize``: hf name -> type name);
    ``raw_tensors`` are GGUF names written untouched (as the bytes of ``raw_types[name]`` if given)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {**kv, **(tokenizer or tiny_byte_level_vocab())}.items():
        key = key if "." in key and not key.startswith(("attention.", "rope.")) else f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(value))
    for name, arr in tensors.items():
        qtype = (quantize or {}).get(name)
        if qtype:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, t), raw_dtype=t)
        else:
            w.add_tensor(gguf_name(name), arr)
    for name, arr in (raw_tensors or {}).items():
        kind = (raw_types or {}).get(name)
        w.add_tensor(name, arr, raw_dtype=gguf.GGMLQuantizationType[kind] if kind else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str] | None = None) -> Path:
    """A minimal safetensors writer (the format is a JSON header and raw bytes), so tests can
    make files the torch-side writer would refuse to (odd dtypes, duplicate tied weights)."""
    import json
    import struct

    names = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("float64"): "F64",
             np.dtype("int8"): "I8"}
    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        kind = (dtypes or {}).get(name, names[arr.dtype])
        header[name] = {"dtype": kind, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path
