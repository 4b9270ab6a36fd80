#!/usr/bin/env python3
"""A Llama-shaped GGUF of a chosen size with random weights and SmolLM2's tokenizer, for speed and memory
benchmarks at the sizes people run (1B-8B) without fetching a model: both servers read the same file.

Random weights give meaningless text but the same work per token as a trained model of that shape (the
kernels do not look at the values); the benchmark fixes the output length, so the answers' content does not
matter. Metadata (tokenizer, chat template, special tokens) is copied from the bundled SmolLM2 file; the
shape keys are replaced. Projections are quantised to ``--qtype`` (Q4_0, Q4_1 or Q8_0) by the ``gguf``
package, the token embedding (tied with the head) to Q8_0, as SmolLM2's file stores it; norms stay float32.

Usage:
    .venv/bin/python benchmarks/make_shaped_gguf.py OUT.gguf [--shape 1b] [--qtype Q4_1] [--seed 0]
Shapes: 1b (hidden 2048, 16 layers, 32 query / 8 KV heads, FFN 8192: Llama 3.2 1B's shape), 3b.
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
}


def main() -> None:
    import gguf

    from inferflux.backends.models import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--qtype", choices=["Q4_0", "Q4_1", "Q8_0"], default="Q4_1")
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
    qtype = gguf.GGMLQuantizationType[args.qtype]

    def add(name: str, rows: int, cols: int, kind: gguf.GGMLQuantizationType) -> None:
        w = (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)

    add("token_embd.weight", vocab, hidden, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(shape["block_count"]):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", ffn, hidden),
                                 ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            add(f"blk.{i}.{name}.weight", rows, cols, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.0f} MB): {args.shape}-shaped llama, {args.qtype}")


if __name__ == "__main__":
    main()
