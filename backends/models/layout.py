"""The weights a ``ModelConfig`` implies: canonical (Hugging Face) names, shapes, and how
the backends hold them. The one place this is written down.

Both loaders check a file's tensor headers against :func:`check_tensors` before any data
is read, so a mismatch between metadata and weights fails at open time with the tensor
named, not later inside a matmul. Both backends take their weights through
:func:`assemble`, which hands each :class:`Destination` (one weight as a backend holds
it: q/k/v fused, gate/up fused) its data; a backend only maps a destination's ``role``
to where it keeps it.

Optional destinations are the biases only some checkpoints of an architecture carry
(Llama's and Qwen3's ``attention_bias`` also biases ``o_proj``; Llama's ``mlp_bias``
biases the MLP). A backend adds the ones a checkpoint has and skips the rest; a
destination given in part (a gate bias without its up bias) is refused at open time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Iterator, Mapping

import numpy as np

from inferflux.backends.models.config import ModelConfig
from inferflux.backends.models.errors import ModelLoadError

Shape = tuple[int, ...]

@dataclass(frozen=True)
class Destination:
    """One weight as the backends hold it: its canonical tensors concatenated along dim 0.

    ``role`` is ``embed``, ``norm`` or ``head`` for the model-wide weights (``layer`` None),
    else a layer's ``input_norm``, ``post_attention_norm``, ``qkv``, ``o_proj``, ``gate_up``,
    ``down``, ``qkv_bias``, ``q_norm``, ``k_norm``, ``o_proj_bias``, ``gate_up_bias`` or
    ``down_bias``. Linear weights are ``[out, in]``, as the files store them.
    """

    role: str
    layer: int | None
    parts: tuple[tuple[str, Shape], ...]  # (canonical name, shape) in concatenation order
    optional: bool = False  # a bias only some checkpoints carry: absent means none is added

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.parts)

    @property
    def shape(self) -> Shape:
        first = self.parts[0][1]
        return (sum(shape[0] for _, shape in self.parts), *first[1:])


def destinations(config: ModelConfig) -> list[Destination]:
    """Every weight of a ``config`` model, model-wide ones first, then layer by layer."""
    h, hd = config.hidden_size, config.head_dim
    q_out, kv_out, inter = config.num_heads * hd, config.num_kv_heads * hd, config.intermediate_size
    out = [_single("embed", None, "model.embed_tokens.weight", (config.vocab_size, h)),
           _single("norm", None, "model.norm.weight", (h,))]
    if not config.tie_word_embeddings:
        out.append(_single("head", None, "lm_head.weight", (config.vocab_size, h)))
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv = ((p + "self_attn.q_proj", q_out), (p + "self_attn.k_proj", kv_out), (p + "self_attn.v_proj", kv_out))
        gate_up = ((p + "mlp.gate_proj", inter), (p + "mlp.up_proj", inter))
        out += [
            _single("input_norm", i, p + "input_layernorm.weight", (h,)),
            _single("post_attention_norm", i, p + "post_attention_layernorm.weight", (h,)),
            _fused("qkv", i, qkv, ".weight", (h,)),
            _single("o_proj", i, p + "self_attn.o_proj.weight", (h, q_out)),
            _fused("gate_up", i, gate_up, ".weight", (h,)),
            _single("down", i, p + "mlp.down_proj.weight", (h, inter)),
        ]
        if config.attention_bias:
            out.append(_fused("qkv_bias", i, qkv, ".bias", ()))
        if config.qk_norm:
            out += [_single("q_norm", i, p + "self_attn.q_norm.weight", (hd,)),
                    _single("k_norm", i, p + "self_attn.k_norm.weight", (hd,))]
        out += [
            _single("o_proj_bias", i, p + "self_attn.o_proj.bias", (h,), optional=True),
            _fused("gate_up_bias", i, gate_up, ".bias", (), optional=True),
            _single("down_bias", i, p + "mlp.down_proj.bias", (h,), optional=True),
        ]
    return out


def _single(role: str, layer: int | None, name: str, shape: Shape, optional: bool = False) -> Destination:
    return Destination(role, layer, ((name, shape),), optional)


def _fused(role: str, layer: int, stems: tuple[tuple[str, int], ...], suffix: str, inner: Shape,
           optional: bool = False) -> Destination:
    """Projections ``stems`` (name stem, output rows) stacked: ``.weight`` with ``inner`` = (in,), ``.bias`` with ()."""
    return Destination(role, layer, tuple((stem + suffix, (rows, *inner)) for stem, rows in stems), optional)


def expected_tensors(config: ModelConfig) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """``(required, optional)`` canonical tensor shapes, ``[out, in]`` for linear weights."""
    required: dict[str, Shape] = {}
    optional: dict[str, Shape] = {}
    for d in destinations(config):
        (optional if d.optional else required).update(d.parts)
    return required, optional


def check_tensors(config: ModelConfig, shapes: Mapping[str, Shape], source: str) -> None:
    """Raise ``ModelLoadError`` unless ``shapes`` (canonical name -> shape) fits ``config``."""
    dests = destinations(config)
    want = {name: shape for d in dests for name, shape in d.parts}
    missing = [name for d in dests if not d.optional for name in d.names if name not in shapes]
    if missing:
        raise ModelLoadError(
            f"{source}: missing {len(missing)} tensor(s) for a {config.architecture} model, e.g. {missing[0]}",
            {"path": source, "missing": missing[:20]},
        )
    for name, shape in shapes.items():
        if name not in want:
            raise ModelLoadError(
                f"{source}: unexpected tensor {name} for a {config.architecture} model",
                {"path": source, "tensor": name},
            )
        if tuple(shape) != want[name]:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {list(shape)}, the config implies {list(want[name])}",
                {"path": source, "tensor": name},
            )
    for d in dests:
        given = [name for name in d.names if name in shapes]
        if given and len(given) < len(d.parts):  # only optional ones can get here
            absent = [name for name in d.names if name not in shapes]
            raise ModelLoadError(
                f"{source}: tensor {given[0]} comes without {', '.join(absent)}; these biases go together",
                {"path": source, "tensor": absent[0]},
            )


def assemble(
    config: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]], absent: Collection[str] = ()
) -> Iterator[tuple[Destination, np.ndarray]]:
    """Each destination with its data (parts concatenated), as soon as all its parts are in.
    ``absent``: tensors the caller has left out of the stream on purpose (it holds them another
    way: the file's blocks); they are not missing, and one that comes anyway is refused.

    ``tensors`` streams canonical ``(name, array)`` pairs, as ``ModelSource.tensors()`` does;
    since a file keeps a layer's tensors together, at most about one layer's parts are held
    at once. Raises ``ValueError`` naming the tensor that is unknown, of the wrong shape or
    given twice, and at the end of the stream the required (or partly given optional) ones
    that never came. Backends turn it into their load error.
    """
    dests = destinations(config)
    owner = {name: (index, shape) for index, d in enumerate(dests) for name, shape in d.parts}
    pending: dict[int, dict[str, np.ndarray]] = {}
    seen: set[str] = set()
    for name, array in tensors:
        if name not in owner or name in absent:
            raise ValueError(f"unexpected tensor in model file: {name}")
        if name in seen:
            raise ValueError(f"tensor {name} appears twice in the model file")
        seen.add(name)
        index, shape = owner[name]
        if tuple(array.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(array.shape)} != expected {shape}")
        got = pending.setdefault(index, {})
        got[name] = array
        d = dests[index]
        if len(got) == len(d.parts):
            del pending[index]
            yield d, got[name] if len(d.parts) == 1 else np.concatenate([got[n] for n in d.names], axis=0)
    missing = [name for i, d in enumerate(dests) if not d.optional or i in pending
               for name in d.names if name not in seen and name not in absent]
    if missing:
        raise ValueError(f"model file lacks tensors: {sorted(missing)[:8]}")
