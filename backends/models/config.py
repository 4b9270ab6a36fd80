"""The shape of a decoder-only transformer, independent of the file it came from.

Both loaders (GGUF and Hugging Face safetensors) produce the same ``ModelConfig`` so a
backend never has to know which kind of file it was given.

``rope_scaling`` is ``None`` or one of these dicts (the Hugging Face spelling where one exists):

* ``{"rope_type": "linear", "factor": f}`` -- positions divided by ``f``;
* ``{"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
  "original_max_position_embeddings": n}`` -- Llama 3.1's piecewise frequency scaling;
* ``{"rope_type": "freq_factors", "freq_factors": (..., head_dim // 2 floats)}`` -- what a
  llama.cpp GGUF stores for Llama 3.1 instead (the ``rope_freqs`` tensor): each inverse
  frequency is divided by its factor.

Rather than re-deriving these, a backend should call :meth:`ModelConfig.rope_inv_freq`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from inferflux.backends.base import ModelInfo
from inferflux.backends.models.errors import ModelLoadError

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3")
ROPE_TYPES: tuple[str, ...] = ("linear", "llama3", "freq_factors")

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # 'llama' | 'qwen2' | 'qwen3'
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    context_length: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (qwen2; some llama fine-tunes)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (qwen3)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ModelLoadError`` if this is not a model the backends can run."""
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported model architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
                {"architecture": self.architecture},
            )
        for field_name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers",
            "num_heads", "num_kv_heads", "head_dim", "context_length",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"model config {field_name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ModelLoadError(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ModelLoadError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        for field_name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, field_name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ModelLoadError(f"{field_name} {value} is outside the vocabulary (size {self.vocab_size})")
        _validate_rope_scaling(self.rope_scaling, self.head_dim)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def model_info(self, name: str, dtype: str) -> ModelInfo:
        """What the engine needs to know about this model, served as ``name`` in ``dtype``."""
        return ModelInfo(
            name=name,
            architecture=self.architecture,
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            hidden_size=self.hidden_size,
        )

    def rope_inv_freq(self) -> np.ndarray:
        """The ``head_dim // 2`` inverse frequencies of the rotary embedding, scaling applied.

        float64: the angles ``pos * inv_freq`` lose precision at long positions in float32,
        so compute them in float64 and cast the cos/sin tables.
        """
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        scaling = self.rope_scaling
        if scaling is None:
            return inv_freq
        kind = scaling["rope_type"]
        if kind == "linear":
            return inv_freq / float(scaling["factor"])
        if kind == "freq_factors":
            return inv_freq / np.asarray(scaling["freq_factors"], dtype=np.float64)
        # llama3: leave high frequencies alone, divide low ones by `factor`, blend in between.
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return np.where(medium, smoothed, scaled)


def _validate_rope_scaling(scaling: Mapping[str, Any] | None, head_dim: int) -> None:
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    if kind not in ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_TYPES)}",
            {"rope_scaling": dict(scaling)},
        )
    if kind == "freq_factors":
        factors = scaling.get("freq_factors")
        if factors is None or len(factors) != head_dim // 2:
            raise ModelLoadError(f"rope freq_factors must hold head_dim // 2 = {head_dim // 2} values")
        return
    missing = [k for k in (("factor",) if kind == "linear" else _LLAMA3_KEYS) if k not in scaling]
    if missing:
        raise ModelLoadError(f"{kind} rope scaling is missing {', '.join(missing)}", {"rope_scaling": dict(scaling)})
    if not float(scaling["factor"]) > 0:
        raise ModelLoadError(f"rope scaling factor must be positive, got {scaling['factor']!r}")


def rope_scaling_from_hf(raw: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Normalise a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict to our format.

    Older configs spell the kind ``type``, newer ones ``rope_type``; ``default`` means none.
    Kinds we cannot run (yarn, dynamic, longrope, ...) are kept so validation names them.
    """
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(raw["factor"])} if "factor" in raw else {"rope_type": kind}
    if kind == "llama3":
        out: dict[str, Any] = {"rope_type": "llama3"}
        for key in _LLAMA3_KEYS:
            if key in raw:
                out[key] = float(raw[key]) if key != "original_max_position_embeddings" else int(raw[key])
        return out
    return {"rope_type": kind}
