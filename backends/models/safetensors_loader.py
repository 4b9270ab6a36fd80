"""Opening a Hugging Face model directory: config.json, *.safetensors, tokenizer.json.

Safetensors files are parsed here (8-byte header length, JSON header, raw little-endian
data) rather than with ``safetensors.numpy``, because numpy has no bfloat16 and most
checkpoints are stored in it: we widen bf16 to float32 (exact) while reading.
"""

from __future__ import annotations

import json
import os
import struct
from functools import cached_property
from typing import Any, Collection, Iterator, Mapping

import numpy as np

from inferflux.backends.models.config import ModelConfig, rope_scaling_from_hf
from inferflux.backends.models.errors import ModelLoadError
from inferflux.backends.models.layout import check_tensors
from inferflux.backends.models.tokenizer import Tokenizer

_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit; larger means a corrupt file

# Buffers some older checkpoints saved alongside the weights; recomputed by every backend.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

# Defaults of the transformers config classes, for keys a config.json may omit.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False},
}


class _TensorRef:
    __slots__ = ("file", "dtype", "shape", "start", "end")

    def __init__(self, file: str, dtype: str, shape: tuple[int, ...], start: int, end: int) -> None:
        self.file, self.dtype, self.shape, self.start, self.end = file, dtype, shape, start, end


def read_safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    """``(header, data_start)`` of one ``.safetensors`` file."""
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ValueError("file is shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw_len)
            if n > _MAX_HEADER:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"not a readable safetensors file: {path}: {e}", {"path": path}) from e
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsModel:
    """A model stored as a Hugging Face directory."""

    format = "safetensors"

    def __init__(self, path: str) -> None:
        self.path = path
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ModelLoadError(f"no config.json in model directory {path}", {"path": path})
        try:
            with open(config_path, encoding="utf-8") as f:
                self.hf_config: dict[str, Any] = json.load(f)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{config_path}: not valid JSON: {e}", {"path": config_path}) from e
        self._refs = self._index_tensors()
        self.config = self._read_config()
        if self.config.tie_word_embeddings:
            self._refs.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
        check_tensors(self.config, {name: ref.shape for name, ref in self._refs.items()}, path)

    def _read_config(self) -> ModelConfig:
        c = self.hf_config
        arch = c.get("model_type")
        if arch not in _ARCH_DEFAULTS:
            raise ModelLoadError(
                f"{self.path}: unsupported model architecture {arch!r}; supported: {', '.join(_ARCH_DEFAULTS)}",
                {"path": self.path, "architecture": arch},
            )
        defaults = _ARCH_DEFAULTS[arch]
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{self.path}: hidden_act {act!r} is not supported (only silu)", {"path": self.path})
        if c.get("use_sliding_window"):
            raise ModelLoadError(f"{self.path}: sliding-window attention is not supported", {"path": self.path})
        # transformers >= 5 writes rope_parameters (with rope_theta inside); older, rope_theta + rope_scaling.
        rope = c.get("rope_parameters") or {}
        try:
            heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            eos = c.get("eos_token_id")
            kwargs = dict(
                architecture=arch,
                vocab_size=int(c["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(c["intermediate_size"]),
                num_layers=int(c["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or hidden // heads),
                rms_norm_eps=float(c.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6))),
                rope_theta=float(rope.get("rope_theta", c.get("rope_theta", defaults.get("rope_theta", 10000.0)))),
                rope_scaling=rope_scaling_from_hf(rope or c.get("rope_scaling")),
                context_length=int(c.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(c.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))),
                # Qwen2's q/k/v always carry a bias; the others say so in attention_bias.
                attention_bias=True if arch == "qwen2" else bool(c.get("attention_bias", False)),
                qk_norm=arch == "qwen3",
                bos_token_id=c.get("bos_token_id"),
                eos_token_id=eos[0] if isinstance(eos, list) and eos else (eos if isinstance(eos, int) else None),
                name=os.path.basename(os.path.normpath(self.path)),
            )
        except KeyError as e:
            raise ModelLoadError(f"{self.path}: config.json is missing {e.args[0]}", {"path": self.path}) from e
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{self.path}: config.json has a bad value: {e}", {"path": self.path}) from e
        try:
            return ModelConfig(**kwargs)
        except ModelLoadError as e:
            raise ModelLoadError(f"{self.path}: {e.message}", {**e.details, "path": self.path}) from e

    def _index_tensors(self) -> dict[str, _TensorRef]:
        index_path = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    weight_map: Mapping[str, str] = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ModelLoadError(f"{index_path}: unreadable shard index: {e}", {"path": index_path}) from e
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise ModelLoadError(f"no *.safetensors weights in model directory {self.path}", {"path": self.path})
        refs: dict[str, _TensorRef] = {}
        for name in files:
            file = os.path.join(self.path, name)
            header, data_start = read_safetensors_header(file)
            for tensor, info in header.items():
                if tensor.endswith(_IGNORED_SUFFIXES):
                    continue
                try:
                    dtype, shape, (start, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
                except (KeyError, TypeError, ValueError) as e:
                    raise ModelLoadError(f"{file}: bad header entry for {tensor}", {"path": file}) from e
                if dtype not in _DTYPES:
                    raise ModelLoadError(f"{file}: tensor {tensor} has dtype {dtype}; supported: F32, F16, BF16",
                                         {"path": file, "tensor": tensor})
                if end - start != int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype].itemsize:
                    raise ModelLoadError(f"{file}: tensor {tensor} byte range does not match its shape",
                                         {"path": file, "tensor": tensor})
                if tensor in refs:
                    raise ModelLoadError(f"{file}: tensor {tensor} appears in more than one file",
                                         {"path": file, "tensor": tensor})
                refs[tensor] = _TensorRef(file, dtype, shape, data_start + int(start), data_start + int(end))
        return refs

    def tensors(self, skip: Collection[str] = ()) -> Iterator[tuple[str, np.ndarray]]:
        """``(hf_name, array)`` per tensor; float32 for F32/BF16 checkpoints, float16 for F16.
        Those named in ``skip`` are left out (as ``GGUFModel.tensors``; this format has no blocks to keep).

        Each array is a fresh, writable, C-contiguous copy (never a view of the file).
        """
        if self._refs is None:
            raise ModelLoadError(f"{self.path}: the model source is closed", {"path": self.path})
        maps: dict[str, np.memmap] = {}
        try:
            for name, ref in self._refs.items():
                if name in skip:
                    continue
                mm = maps.get(ref.file)
                if mm is None:
                    mm = maps[ref.file] = np.memmap(ref.file, dtype=np.uint8, mode="r")
                if ref.end > mm.shape[0]:
                    raise ModelLoadError(f"{ref.file}: truncated, tensor {name} runs past the end",
                                         {"path": ref.file, "tensor": name})
                raw = np.asarray(mm[ref.start : ref.end]).view(_DTYPES[ref.dtype])
                if ref.dtype == "BF16":
                    wide = raw.astype(np.uint32)
                    wide <<= 16  # bfloat16 is the top half of a float32
                    arr = wide.view(np.float32)
                else:
                    arr = raw.copy()
                yield name, arr.reshape(ref.shape)
        finally:
            maps.clear()

    @cached_property
    def _tokenizer(self) -> Tokenizer:
        return Tokenizer.from_hf_dir(self.path, self.hf_config)

    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def close(self) -> None:
        self._refs = None  # type: ignore[assignment]
