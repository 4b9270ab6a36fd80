"""The canonical (Hugging Face) tensor names and shapes a ``ModelConfig`` implies.

Both loaders check a file's tensor headers against this before any data is read, so a
mismatch between metadata and weights fails at open time with the tensor named, not later
inside a matmul.
"""

from __future__ import annotations

from typing import Mapping

from backends.models.config import ModelConfig
from backends.models.errors import ModelLoadError

Shape = tuple[int, ...]


def expected_tensors(config: ModelConfig) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """``(required, optional)`` tensor shapes, ``[out, in]`` for linear weights.

    Optional are the biases only some checkpoints of an architecture carry (Llama's
    ``attention_bias`` also biases ``o_proj``; ``mlp_bias`` biases the MLP): a backend should
    apply any ``*.bias`` it is given.
    """
    h, hd = config.hidden_size, config.head_dim
    q_out, kv_out, inter = config.num_heads * hd, config.num_kv_heads * hd, config.intermediate_size
    required: dict[str, Shape] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    optional: dict[str, Shape] = {}
    if not config.tie_word_embeddings:
        required["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        required.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if config.attention_bias:
            required.update({
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            })
        if config.qk_norm:
            required.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        optional.update({
            p + "self_attn.o_proj.bias": (h,),
            p + "mlp.gate_proj.bias": (inter,),
            p + "mlp.up_proj.bias": (inter,),
            p + "mlp.down_proj.bias": (h,),
        })
    return required, optional


def check_tensors(config: ModelConfig, shapes: Mapping[str, Shape], source: str) -> None:
    """Raise ``ModelLoadError`` unless ``shapes`` (canonical name -> shape) fits ``config``."""
    required, optional = expected_tensors(config)
    missing = [name for name in required if name not in shapes]
    if missing:
        raise ModelLoadError(
            f"{source}: missing {len(missing)} tensor(s) for a {config.architecture} model, e.g. {missing[0]}",
            {"path": source, "missing": missing[:20]},
        )
    for name, shape in shapes.items():
        want = required.get(name, optional.get(name))
        if want is None:
            raise ModelLoadError(
                f"{source}: unexpected tensor {name} for a {config.architecture} model",
                {"path": source, "tensor": name},
            )
        if tuple(shape) != want:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {list(shape)}, the config implies {list(want)}",
                {"path": source, "tensor": name},
            )
