#!/usr/bin/env python3
"""A Llama-shaped GGUF of a chosen size with random weights and SmolLM2's tokenizer, for speed and memory
benchmarks at the sizes people run (1B-8B) without fetching a model: both servers read the same file.

Random weights give meaningless text but the same work per token as a trained model of that shape (the
kernels do not look at the values); the benchmark fixes the output length, so the answers' content does not
matter. Metadata (tokenizer, chat template, special tokens) is copied from the bundled SmolLM2 file; the
shape keys are replaced. Projections are quantised to ``--qtype`` (Q4_0, Q4_1 or Q8_0) by the ``gguf``
package, the token embedding (tied with the head) to Q8_0, as SmolLM2's file stores it; norms stay float32.
``--qtype Q4_K_M`` lays the file out as llama.cpp's Q4_K_M does (llama-quant.cpp): Q6_K for the tied
embedding (it is the output head) and for attn_v and ffn_down of the layers ``use_more_bits`` picks (the first
and last eighth, and every third between), Q4_K for every other projection. gguf-py cannot quantise the K
types, so those are random but valid super-blocks written raw (``quants.random_k_blocks``: random quants
and scales, small positive float16 ``d``), sized so the weights' spread is about the other types'.

Usage:
    .venv/bin/python benchmarks/make_shaped_gguf.py OUT.gguf [--shape 1b] [--qtype Q4_1] [--seed 0]
Shapes: 1b (hidden 2048, 16 layers, 32 query / 8 KV heads, FFN 8192: Llama 3.2 1B's shape), 3b, tiny (the
tests': hidden 256, 2 layers).
Types: Q4_0, Q4_1, Q8_0, Q4_K_M (``--type`` is the same option; the name's case does not matter).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SHAPES = {
    "1b": {"embedding_length": 2048, "block_count": 16, "attention.head_count": 32, "attention.head_count_kv": 8,
           "feed_forward_length": 8192},
    "3b": {"embedding_length": 3072, "block_count": 28, "attention.head_count": 24, "attention.head_count_kv": 8,
           "feed_forward_length": 8192},
    # The tests' (tests/backends/cpu/test_cpu_passes.py): a file of each layout in seconds.
    "tiny": {"embedding_length": 256, "block_count": 2, "attention.head_count": 4, "attention.head_count_kv": 2,
             "feed_forward_length": 512},
}


QTYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K_M")


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down Q4_K_M stores in Q6_K (llama-quant.cpp)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def main() -> None:
    import gguf

    from inferflux.backends.models import default_model_path
    from inferflux.backends.models.quants import random_k_blocks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--qtype", "--type", type=str.upper, choices=QTYPES, default="Q4_1")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    reader = gguf.GGUFReader(default_model_path())
    arch = "llama"
    writer = gguf.GGUFWriter(str(args.out), arch)
    replaced = {f"{arch}.{k}" for k in (*shape, "rope.dimension_count")}
    for field in reader.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture" or name in replaced:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            values = [field.parts[i] for i in field.data]
            if sub == gguf.GGUFValueType.STRING:
                writer.add_array(name, [bytes(v).decode("utf-8") for v in values])
            else:
                writer.add_array(name, [v.tolist()[0] for v in values])
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], kind)
    for key, value in shape.items():
        writer.add_uint32(f"{arch}.{key}", value)
    hidden, heads = shape["embedding_length"], shape["attention.head_count"]
    head_dim = hidden // heads
    writer.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    kv = shape["attention.head_count_kv"] * head_dim
    ffn = shape["feed_forward_length"]
    rng = np.random.default_rng(args.seed)
    k_quants = args.qtype == "Q4_K_M"
    Q = gguf.GGMLQuantizationType
    qtype = Q.Q4_K if k_quants else Q[args.qtype]
    # A K super-block's weights spread about d times this (the quants' and scales' spread: 4.6 x 31.5 for Q4_K's
    # 0..15 and 0..63, 18.5 x 74 for Q6_K's -32..31 and int8 scales), so d near std / spread gives weights of
    # about the standard deviation the other types get, 1 / sqrt(cols).
    spread = {Q.Q4_K: 145.0, Q.Q6_K: 1370.0}

    def add(name: str, rows: int, cols: int, kind: gguf.GGMLQuantizationType) -> None:
        if kind in spread:
            d = 1 / np.sqrt(cols) / spread[kind]
            writer.add_tensor(name, random_k_blocks(kind, rows, cols, rng, (d / 2, d * 2)), raw_dtype=kind)
            return
        w = (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)

    add("token_embd.weight", vocab, hidden, Q.Q6_K if k_quants else Q.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    layers = shape["block_count"]
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        more_bits = k_quants and use_more_bits(i, layers)
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", ffn, hidden),
                                 ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            kind = Q.Q6_K if more_bits and name in ("attn_v", "ffn_down") else qtype
            add(f"blk.{i}.{name}.weight", rows, cols, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.0f} MB): {args.shape}-shaped llama, {args.qtype}")


if __name__ == "__main__":
    main()
