"""The ``quantise`` load pass of the CPU backend: each dense projection, the embedding and the head
replaced by blocks of a ggml type, the file's own or a re-quantisation (``passes.py`` runs it
after the fusing passes; ``pass_config.py`` names the modes).

A ``Slot`` is one weight the pass may replace, named by its canonical tensors
(``backends/models/layout.py``), so that the file's stored blocks for exactly
those tensors (fused q/k/v and gate/up stacked in the same order) take its place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from inferflux.backends.cpu import linear as ql
from inferflux.backends.cpu.pass_config import DENSE_DTYPES, EXACT_MODES, FILE_BLOCK_MODES, KEEP_DENSE_MODES, PassConfig
from inferflux.backends.models import layout

# The ggml types int8 and int4 re-quantise to.
_REQUANT = {"int8": 8, "int4": 3}  # Q8_0, Q4_1
_LINEAR_ROLES = ("qkv", "o_proj", "gate_up", "down")


def quantise(model: Any, source: Any, config: PassConfig, mode: str) -> tuple[str, str]:
    """The pass: every slot whose blocks ``mode`` gives (the file's, or re-quantised) takes them."""
    if mode in DENSE_DTYPES:
        return "skipped", f"dense {DENSE_DTYPES[mode]} weights"
    keep_dense = mode in KEEP_DENSE_MODES
    counts: dict[str, int] = {}
    dense_left = 0
    absent = model.absent_weights
    for slot in slots(model):
        parts = blocks_for(slot, source, mode)
        if parts is None:
            if absent.intersection(slot.names):  # its dense weights were never read: it must not run on them
                raise ValueError(f"quantise: {slot.names[0]} was left to the file's blocks at load, which {mode} "
                                 "does not take")
            dense_left += 1
            continue
        slot.replace(parts, slot.dense().detach() if keep_dense else None)
        kind = "+".join(dict.fromkeys(ql.QTYPE_NAMES[qtype] for qtype, _ in parts))  # Q4_K+Q6_K: stacked
        counts[kind] = counts.get(kind, 0) + 1
    kept = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
    how = ("kept as stored in the file" + (", beside their dense weights for batches" if keep_dense else "")
           if mode in FILE_BLOCK_MODES else f"re-quantised ({mode})")
    if absent:
        how += ", never decoded to dense weights"
    detail = f"{kept or 'no'} projections {how}" + (f"; {dense_left} left dense (no kernel for their type)"
                                                     if dense_left else "")
    return "ran", detail


@dataclass
class Slot:
    """One dense weight the quantise pass may replace: a layer projection, the embedding or the head."""

    model: Any
    role: str
    layer: int | None
    names: tuple[str, ...]  # canonical tensor names, in fused order

    def dense(self) -> torch.Tensor:
        if self.role == "embed":
            return self.model.embed.weight
        if self.role == "head":
            return self.model.lm_head.weight
        return self._owner()[0].weight

    def _owner(self) -> tuple[nn.Module, str]:
        block = self.model.layers[self.layer]
        parent = block.attn if self.role in ("qkv", "o_proj") else block.mlp
        return getattr(parent, self.role), self.role

    def replace(self, parts: list[tuple[int, np.ndarray]], dense: torch.Tensor | None = None) -> None:
        """Put the blocks (``blocks_for``'s parts) in this weight's place; ``dense`` (hybrid): kept beside them
        for batches."""
        m = self.model
        qtype, blocks = parts[0][0], torch.from_numpy(parts[0][1])  # the embedding and head: one tensor, one part
        if self.role == "embed":
            m.embed = ql.QuantEmbedding(blocks, qtype, m.cfg.hidden_size, m.dtype)
            if m.lm_head is None:  # tied: the head multiplies the same blocks
                m.head_linear = ql.QuantHead(ql.QuantLinear(m.embed.blocks, qtype, m.cfg.hidden_size, dense=dense))
            return
        if self.role == "head":
            m.head_linear = ql.QuantHead(ql.QuantLinear(blocks, qtype, m.cfg.hidden_size, dense=dense))
            m.lm_head = _Placeholder()
            return
        old, name = self._owner()
        parent = m.layers[self.layer].attn if self.role in ("qkv", "o_proj") else m.layers[self.layer].mlp
        bias = None if old.bias is None else old.bias.detach()
        blocks_parts = [(t, torch.from_numpy(b)) for t, b in parts]
        setattr(parent, name, ql.quant_linear(blocks_parts, old.in_features, bias, dense=dense))


class _Placeholder(nn.Module):
    """An untied head whose weights live in ``head_linear``'s blocks: ``weight`` is an empty
    tensor, which ``Transformer.forward`` hands to ``head_linear`` unused."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty(0), persistent=False)


def slots(model: Any) -> list[Slot]:
    by_role = {(d.role, d.layer): d for d in layout.destinations(model.cfg)}
    out = [Slot(model, "embed", None, by_role[("embed", None)].names)]
    if ("head", None) in by_role:
        out.append(Slot(model, "head", None, by_role[("head", None)].names))
    for i in range(model.cfg.num_layers):
        out += [Slot(model, role, i, by_role[(role, i)].names) for role in _LINEAR_ROLES]
    return out


def file_block_names(model: Any, source: Any, mode: str) -> frozenset[str]:
    """The tensors whose stored blocks ``quantise`` will put in place with no dense copy beside them
    (``blocks``, ``native``): a loader need not decode them at all (``Transformer.load_weights``'
    ``absent``). Asked of the file's types before the weights are read, as ``blocks_for`` decides."""
    stored_type = getattr(source, "stored_type", None)
    if mode not in FILE_BLOCK_MODES or mode in KEEP_DENSE_MODES or stored_type is None:
        return frozenset()
    return frozenset(name for slot in slots(model) if _keeps_file_blocks(slot, [stored_type(n) for n in slot.names],
                                                                          mode)
                     for name in slot.names)


def _keeps_file_blocks(slot: Slot, types: list[int | None], mode: str) -> bool:
    """Whether a slot whose tensors the file stores in ``types`` takes those blocks in ``mode``: every part
    quantised in a type the mode's kernel multiplies for the model's dtype; types mixed only in the exact
    modes."""
    exact = mode in EXACT_MODES
    return (all(t is not None for t in types) and (len(set(types)) == 1 or exact)
            and all(ql.multiplies(t, exact=exact, dtype=slot.model.dtype) for t in types))  # type: ignore[arg-type]


def blocks_for(slot: Slot, source: Any, mode: str) -> list[tuple[int, np.ndarray]] | None:
    """The blocks a slot becomes, ``(ggml type, uint8 [rows, row_bytes])`` a tensor in output order (a fused
    slot's q, k, v): the file's (native), or a re-quantisation of its weights; None: it stays dense. The parts may
    differ in type (Q4_K_M's v in Q6_K beside q and k in Q4_K) only in the exact modes, whose kernel computes each
    output by itself (``ql.quant_linear`` stacks them)."""
    if mode in FILE_BLOCK_MODES:
        stored = getattr(source, "stored_blocks", None)
        parts = [stored(n) for n in slot.names] if stored is not None else [None]
        if not _keeps_file_blocks(slot, [None if p is None else p[0] for p in parts], mode):
            return None
        return parts  # type: ignore[return-value]  # _keeps_file_blocks saw no None
    from gguf.quants import quantize

    qtype = _REQUANT[mode]
    weights = slot.dense().detach().float().numpy()
    return [(qtype, quantize(weights, qtype))]
