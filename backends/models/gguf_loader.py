"""Opening a GGUF file: metadata -> ``ModelConfig``, tensors -> canonical Hugging Face names.

Tensors come out in Hugging Face layout (``[out, in]``, numpy order -- GGUF lists dims
innermost first) and, for llama, with llama.cpp's q/k row permutation undone, so every
backend applies RoPE in the half-split (``rotate_half``) form regardless of the source.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Any, Collection, Iterator

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from inferflux.backends.models import quants
from inferflux.backends.models.config import ModelConfig
from inferflux.backends.models.errors import ModelLoadError
from inferflux.backends.models.layout import check_tensors
from inferflux.backends.models.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"

# GGUF tensor names -> Hugging Face names (llama.cpp's gguf-py tensor_mapping, reversed).
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 rope scaling, folded into the config


def canonical_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None if it is not one we map."""
    m = _LAYER_RE.fullmatch(gguf_name)
    if m:
        hf = _LAYER_NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{hf}.{m.group(3)}" if hf else None
    m = _GLOBAL_RE.fullmatch(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k projection rows (weights or biases).

    The converter reorders each head's rows from HF's half-split RoPE order
    ``[x0..x(d/2-1), y0..y(d/2-1)]`` to GGML's interleaved ``[x0, y0, x1, y1, ...]``.
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _FastReader(GGUFReader):
    """``GGUFReader`` slicing a plain ndarray view of its memmap.

    Slicing ``np.memmap`` runs Python-level ``__array_finalize__`` on each of the
    ~250k metadata reads a 49k-token vocabulary takes; a plain view cuts opening the
    default model from ~2.5-4 s to ~0.6-0.7 s. Same bytes, same results (tested against
    the stock reader).

    ``_get`` is private to gguf and gguf offers no public way to hand the reader another
    array, so pyproject.toml pins gguf to the minor version this is tested with; on an
    upgrade, rerun tests/backends/models/test_models_gguf.py (it compares the two readers).
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self.__dict__["_plain_data"] = self.data.view(np.ndarray)
        dt = np.dtype(dtype)
        count = int(count)
        arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def _open_reader(path: str) -> GGUFReader:
    return _FastReader(path)


def _field_value(field: Any) -> Any:
    """A ``ReaderField`` as a python value (str, int, float, bool, or list of those)."""
    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        if len(field.types) < 2 or not field.data:
            return []
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if field.types[1] == GGUFValueType.ARRAY:
            raise ValueError(f"nested arrays in {field.name} are not supported")
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]][0].item()


class GGUFModel:
    """A model stored as one GGUF file."""

    format = "gguf"

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"not a GGUF file (bad magic {magic!r}): {path}", {"path": path})
        try:
            self._reader = _open_reader(path)
        except Exception as e:  # gguf raises ValueError/IndexError/KeyError on a corrupt header
            raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}", {"path": path}) from e
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.config = self._read_config()
        check_tensors(self.config, {canonical_name(n) or n: self._shape(t) for n, t in self._tensors.items()
                                    if n != _ROPE_FREQS}, path)

    # ----- metadata -----------------------------------------------------------------

    def metadata(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            return default
        try:
            return _field_value(field)
        except (ValueError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{self.path}: cannot read metadata {key}: {e}", {"path": self.path}) from e

    def _require(self, key: str) -> Any:
        value = self.metadata(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata is missing {key}", {"path": self.path, "key": key})
        return value

    def _scalar_int(self, key: str, default: Any = None) -> int:
        value = self.metadata(key, default) if default is not None else self._require(key)
        if isinstance(value, list):  # per-layer values (e.g. OpenELM): not a uniform transformer
            raise ModelLoadError(f"{self.path}: per-layer {key} is not supported", {"path": self.path, "key": key})
        return int(value)

    def _read_config(self) -> ModelConfig:
        arch = self._require("general.architecture")
        p = f"{arch}."
        hidden = self._scalar_int(p + "embedding_length")
        heads = self._scalar_int(p + "attention.head_count")
        kv_heads = self._scalar_int(p + "attention.head_count_kv", heads)
        if "token_embd.weight" not in self._tensors:
            raise ModelLoadError(f"{self.path}: no token_embd.weight tensor", {"path": self.path})
        vocab = self._shape(self._tensors["token_embd.weight"])[0]
        head_dim = self.metadata(p + "attention.key_length")
        if head_dim is None:
            if hidden % heads:
                raise ModelLoadError(f"{self.path}: embedding_length {hidden} is not a multiple of "
                                     f"head_count {heads}", {"path": self.path})
            head_dim = hidden // heads
        value_dim = self.metadata(p + "attention.value_length", head_dim)
        if value_dim != head_dim:
            raise ModelLoadError(f"{self.path}: key_length {head_dim} != value_length {value_dim} is not supported",
                                 {"path": self.path})
        rope_dim = self.metadata(p + "rope.dimension_count", head_dim)
        if rope_dim != head_dim:
            raise ModelLoadError(f"{self.path}: partial rotary embeddings (rope.dimension_count {rope_dim}, "
                                 f"head_dim {head_dim}) are not supported", {"path": self.path})
        kwargs = dict(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=self._scalar_int(p + "feed_forward_length"),
            num_layers=self._scalar_int(p + "block_count"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(self._require(p + "attention.layer_norm_rms_epsilon")),
            rope_theta=float(self.metadata(p + "rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(p),
            context_length=self._scalar_int(p + "context_length"),
            tie_word_embeddings="output.weight" not in self._tensors,
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self._tensors,
            bos_token_id=self.metadata("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.metadata("tokenizer.ggml.eos_token_id"),
            name=str(self.metadata("general.name", "")),
        )
        try:
            return ModelConfig(**kwargs)
        except ModelLoadError as e:
            raise ModelLoadError(f"{self.path}: {e.message}", {**e.details, "path": self.path}) from e

    def _rope_scaling(self, p: str) -> dict[str, Any] | None:
        if _ROPE_FREQS in self._tensors:
            t = self._tensors[_ROPE_FREQS]
            factors = quants.dequantize(t.data, int(t.tensor_type), self._shape(t))
            return {"rope_type": "freq_factors", "freq_factors": tuple(float(x) for x in factors)}
        kind = self.metadata(p + "rope.scaling.type")
        factor = self.metadata(p + "rope.scaling.factor", self.metadata(p + "rope.scale_linear"))
        if kind is None:  # older files spell linear scaling as rope.scale_linear alone
            kind = "none" if factor is None else "linear"
        if kind == "none":
            return None
        if kind == "linear":
            return None if factor in (None, 1.0) else {"rope_type": "linear", "factor": float(factor)}
        return {"rope_type": kind}  # yarn etc.: kept so validation names what is unsupported

    @staticmethod
    def _shape(t: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(t.shape.tolist()))

    # ----- the ModelSource interface ------------------------------------------------

    def tensors(self, skip: Collection[str] = ()) -> Iterator[tuple[str, np.ndarray]]:
        """``(hf_name, array)`` per tensor, in file order; float32, or float16 if stored so. The
        tensors named in ``skip`` are neither decoded nor yielded: a backend that keeps their
        blocks (``stored_blocks``) saves decoding them, in time and in memory.

        Each array is a fresh, writable, C-contiguous copy (never a view of the file).
        """
        if self._reader is None:
            raise ModelLoadError(f"{self.path}: the model source is closed", {"path": self.path})
        cfg = self.config
        unpermute = cfg.architecture == "llama"
        for name, t in self._tensors.items():
            if name == _ROPE_FREQS:
                continue
            hf = canonical_name(name)
            if hf in skip:
                continue
            try:
                arr = quants.dequantize(t.data, int(t.tensor_type), self._shape(t), keep_f16=True)
            except (quants.UnsupportedQuantType, ValueError) as e:
                raise ModelLoadError(f"{self.path}: tensor {name}: {e}", {"path": self.path, "tensor": name}) from e
            if unpermute and hf is not None and (".q_proj." in hf or ".k_proj." in hf):
                arr = np.ascontiguousarray(unpermute_rows(arr, cfg.num_heads if ".q_proj." in hf else cfg.num_kv_heads))
            yield hf, arr  # type: ignore[misc]  # check_tensors guaranteed every name maps

    def stored_blocks(self, hf_name: str) -> tuple[int, np.ndarray] | None:
        """The tensor ``hf_name`` as the file stores it, when quantised: ``(ggml type id,
        uint8 [rows, row_bytes])``, a copy, rows in the model's order; None for float tensors.

        The ``quantise`` pass (backends/cpu/passes.py) keeps these blocks instead of the
        dequantised weights. Llama's q/k rows are unpermuted here as ``tensors()`` does:
        a row's blocks move whole, so the reorder is exact.
        """
        if self._reader is None:
            raise ModelLoadError(f"{self.path}: the model source is closed", {"path": self.path})
        if self.stored_type(hf_name) is None:
            return None
        t = self._by_canonical[hf_name]
        # Read, not copied out of the reader's mapping: the mapped pages would count in the process's
        # resident memory until the source closes, so a load would peak at the weights plus the whole file.
        arr = np.empty(t.data.shape, np.uint8)
        with open(self.path, "rb") as f:
            f.seek(int(t.data_offset))
            if f.readinto(memoryview(arr).cast("B")) != arr.nbytes:
                raise ModelLoadError(f"{self.path}: tensor {t.name} runs past the end of the file",
                                     {"path": self.path, "tensor": t.name})
        if self.config.architecture == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = self.config.num_heads if ".q_proj." in hf_name else self.config.num_kv_heads
            arr = np.ascontiguousarray(unpermute_rows(arr, heads))
        return int(t.tensor_type), arr

    def stored_type(self, hf_name: str) -> int | None:
        """The ggml type ``stored_blocks`` would return the tensor in, without reading it; None for float
        tensors."""
        t = self._by_canonical.get(hf_name)
        if t is None or int(t.tensor_type) in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                                GGMLQuantizationType.BF16):
            return None
        return int(t.tensor_type)

    @cached_property
    def _by_canonical(self) -> dict[str, Any]:
        return {canonical_name(n): t for n, t in self._tensors.items() if n != _ROPE_FREQS}

    @cached_property
    def _tokenizer(self) -> Tokenizer:
        keys = [k for k in self._reader.fields if k.startswith("tokenizer.")]
        meta = {k: self.metadata(k) for k in keys}
        return Tokenizer.from_gguf_metadata(meta, self.path)

    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def close(self) -> None:
        """Drop the file mapping (tensors already yielded stay valid)."""
        self._reader = None  # type: ignore[assignment]
        self._tensors = {}
        self.__dict__.pop("_by_canonical", None)  # its tensors hold views of the mapping too
