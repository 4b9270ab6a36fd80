"""Tiny random Hugging Face checkpoints of every architecture and variant the backends
support, written by transformers itself, and transformers' float32 logits on them: the
oracle the backend tests (tests/backends/conformance, mlx, models) compare against.

Every parameter is random, biases and norm weights included (transformers initialises
those to 0 and 1), so a backend that drops or misplaces one gets other logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from inferflux.backends.base import Batch, SequenceSlice

VOCAB = 96
BLOCK = 4
NUM_BLOCKS = 32  # what run_steps allocates: enough for mixed_steps()

_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# name -> (architecture, transformers config changes): each supported shape once.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    # Scaled rope (Llama 3.1); mixed_steps() runs past the original context of 32.
    "llama3-scaled": ("llama", {"rope_parameters": _LLAMA3_ROPE}),
    # The optional biases: attention_bias also biases o_proj, mlp_bias the whole MLP.
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    # q/k norms, head_dim != hidden / heads
    "qwen3": ("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 1, "head_dim": 32}),
    "qwen3-biases": ("qwen3", {"attention_bias": True, "head_dim": 16}),  # q/k/v and o_proj biases
}


def tiny_hf_model(architecture: str, seed: int = 0, **config: Any) -> Any:
    """transformers' float32 model of ``architecture``: tiny defaults, ``config`` over them."""
    import torch
    import transformers

    defaults = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    hf_config = getattr(transformers, _CLASSES[architecture])(**{**defaults, **config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.5 * noise)
            else:  # weights ~ 1 / sqrt(fan-in) keep activations O(1) through the layers
                param.copy_(noise / param.shape[-1] ** 0.5)
    return model.eval()


def write_variant(directory: Path, variant: str) -> Path:
    """``VARIANTS[variant]`` saved with ``save_pretrained`` (config.json, model.safetensors) in ``directory``."""
    architecture, config = VARIANTS[variant]
    tiny_hf_model(architecture, **config).save_pretrained(directory)
    return directory


def mixed_steps() -> list[list[SequenceSlice]]:
    """Fresh prefills, a continuation chunk with a logits row per token (speculative
    verification), decode rows, and a 70-token sequence (past the llama3-scaled
    variant's original context of 32), over three steps."""
    rng = np.random.default_rng(1)
    a, b, c, d = (rng.integers(0, VOCAB, n).tolist() for n in (9, 11, 3, 70))
    tables = {0: [0, 1, 2], 1: [5, 3, 4], 2: [6], 3: list(range(7, 26))}
    return [
        [SequenceSlice(0, a, 0, tables[0], 9), SequenceSlice(1, b[:5], 0, tables[1], 0),
         SequenceSlice(3, d, 0, tables[3], 1)],
        [SequenceSlice(1, b[5:], 5, tables[1], 6), SequenceSlice(0, [7], 9, tables[0], 1),
         SequenceSlice(2, c, 0, tables[2], 3), SequenceSlice(3, [5, 6], 70, tables[3], 2)],
        [SequenceSlice(3, [1], 72, tables[3], 1), SequenceSlice(2, [8], 3, tables[2], 1)],
    ]


def run_steps(backend: Any, steps: list[list[SequenceSlice]]) -> list[np.ndarray]:
    """Each step's float32 logits from ``backend`` (given a fresh KV cache of NUM_BLOCKS)."""
    backend.allocate_kv(NUM_BLOCKS, BLOCK)
    return [np.asarray(backend.forward(Batch(step, BLOCK)), dtype=np.float32) for step in steps]


def reference_logits(directory: Path, steps: list[list[SequenceSlice]]) -> list[np.ndarray]:
    """What ``run_steps`` should return, from transformers: each sequence run whole, from
    position 0, up to every step, in float32."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    history: dict[int, list[int]] = {}
    out = []
    for step in steps:
        rows = []
        for sl in step:
            ids = history.setdefault(sl.seq_id, [])
            if len(ids) != sl.start_pos:
                raise ValueError(f"sequence {sl.seq_id} is at {len(ids)} tokens, the step starts at {sl.start_pos}")
            ids.extend(sl.token_ids)
            if sl.num_logits:
                with torch.no_grad():
                    logits = model(torch.tensor([ids])).logits[0]
                rows.append(logits[len(ids) - sl.num_logits :].numpy())
        out.append(np.concatenate(rows))
    return out
