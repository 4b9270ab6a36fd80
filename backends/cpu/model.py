"""The decoder-only transformer (llama, qwen2, qwen3) as a plain PyTorch module.

One forward runs a flattened batch of tokens from many sequences; attention reads
keys and values through the paged cache, so prefill chunks, decode steps and
multi-token verification all take the same path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Collection, Iterable, Protocol

import numpy as np
import torch
from torch import nn

from inferflux.backends.models import layout
from inferflux.kernels import reference

if TYPE_CHECKING:
    from inferflux.backends.models import ModelConfig

# kernels.reference.paged_attention's signature, which every implementation shares.
PagedAttention = Callable[..., torch.Tensor]
# A *kernel set* is a module with kernels.reference's functions (names, signatures,
# semantics): kernels.reference itself, kernels.triton, kernels.metal.
KernelSet = ModuleType


# A run of new tokens after cached context (a speculative draft being verified, a
# prompt's tail after its cached prefix) goes through the decode kernel, which reads
# the cache in place, while new tokens x context positions stay under this; past it
# the reference (gather once, then one batched product) is faster. Measured on the
# 2-core CI machine in bfloat16: at 200 positions the kernel wins up to ~9 tokens,
# at 600 it loses already at 5.
CONTINUATION_KERNEL_WORK = 2048


class Linear(nn.Linear):
    """``nn.Linear`` without the random initialisation: every weight comes from the file (or is replaced
    by its blocks). Drawing random values first cost load time, and on the meta device the initialisers'
    Python meta kernels imported torch's compiler (dynamo, sympy, triton: about 100 MiB resident)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """``nn.Embedding`` without the random initialisation, as ``Linear``."""

    def reset_parameters(self) -> None:
        pass


@dataclass
class PrefillGroup:
    """One sequence whose new tokens are a contiguous run ``[start, end)`` of the batch."""

    start: int
    end: int
    fresh: bool  # starts at position 0: attend over the new tokens, no cache read
    block_table: torch.Tensor | None  # [1, num_blocks] when not fresh
    context_len: torch.Tensor | None
    query_start: torch.Tensor | None
    short: bool = False  # few enough new tokens x positions for the decode kernel (CONTINUATION_KERNEL_WORK)


@dataclass
class AttentionMetadata:
    """Everything attention needs about the batch, built once per step."""

    slots: torch.Tensor  # [T] cache slot of every new token
    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor
    # Batch rows that are single-token steps: a slice when they are all of them
    # (the steady state: no gather/scatter needed), else an index tensor.
    decode_rows: slice | torch.Tensor | None
    decode_tables: torch.Tensor | None  # [D, max_blocks], padded
    decode_lens: torch.Tensor | None  # [D]
    decode_starts: torch.Tensor | None  # [D] position of each decode token: decode_lens - 1
    decode_mask: torch.Tensor | None  # [D, q_len * group, max_ctx], shared by every layer; None: built in the kernel
    prefills: list[PrefillGroup]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kernels: KernelSet = reference) -> None:
        super().__init__()
        self.kernels = kernels
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        self.qkv = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False, dtype=dtype)
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim, dtype=dtype)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim, dtype=dtype)) if cfg.qk_norm else None
        # Decode steps' attention; Transformer.use_paged_attention may swap in a compiled kernel.
        self.paged_attention: PagedAttention = kernels.paged_attention
        # Deterministic mode (Transformer.use_invariant_kernels): every query, of a decode step,
        # a prefill chunk or a draft being verified, through self.paged_attention over the cache,
        # so a token's attention is one computation whatever batch or step it is part of.
        self.one_path = False

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None
    ) -> torch.Tensor:
        K = self.kernels
        T = x.shape[0]
        qkv = self.qkv(x)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        qk = qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat(
                (K.rms_norm(qk[:, : self.num_heads], self.q_norm, self.eps),
                 K.rms_norm(qk[:, self.num_heads :], self.k_norm, self.eps)), dim=1)
        # q and k are adjacent in the fused projection: rotate both in one pass.
        qk = K.apply_rope(qk, meta.cos, meta.sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if k_cache is not None:  # None: a step that keeps no KV (embeddings: fresh sequences only)
            K.store_kv(k_cache, v_cache, k, v, meta.slots)

        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            od = self.paged_attention(
                q[meta.decode_rows][:, None], k_cache, v_cache, meta.decode_tables, meta.decode_lens,
                meta.decode_starts, self.scale, mask=meta.decode_mask,
            )
            out[meta.decode_rows] = od[:, 0]
        for p in meta.prefills:
            if self.one_path and k_cache is not None:
                out[p.start : p.end] = self._paged_prefill(q, p, meta.slots, k_cache, v_cache)
            elif p.fresh:
                out[p.start : p.end] = K.causal_attention(
                    q[p.start : p.end], k[p.start : p.end], v[p.start : p.end], self.scale
                )
            else:
                attend = self.paged_attention if p.short else K.paged_attention
                out[p.start : p.end] = attend(
                    q[None, p.start : p.end], k_cache, v_cache, p.block_table,
                    p.context_len, p.query_start, self.scale,
                )[0]
        return self.o_proj(out.view(T, self.q_size))

    def _paged_prefill(
        self, q: torch.Tensor, p: PrefillGroup, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """A prefill group's attention read back from the cache (its keys and values are stored by now)."""
        if p.fresh:  # positions 0..n-1: every block_size-th slot names the next block of the table
            block_size = k_cache.shape[2]
            table = torch.div(slots[p.start : p.end : block_size], block_size, rounding_mode="floor")[None]
            n = torch.tensor([p.end - p.start])
            start = torch.zeros(1, dtype=torch.long)
        else:
            table, n, start = p.block_table, p.context_len, p.query_start
        return self.paged_attention(q[None, p.start : p.end], k_cache, v_cache, table, n, start, self.scale)[0]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kernels: KernelSet = reference) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, dtype=dtype)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.kernels.silu_and_mul(self.gate_up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kernels: KernelSet = reference) -> None:
        super().__init__()
        self.kernels = kernels
        self.eps = cfg.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype))
        self.post_attention_norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype))
        self.attn = Attention(cfg, dtype, kernels)
        self.mlp = MLP(cfg, dtype, kernels)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        K = self.kernels
        if residual is None:
            residual = x
            h = K.rms_norm(x, self.input_norm, self.eps)
        else:
            h, residual = K.add_rms_norm(x, residual, self.input_norm, self.eps)
        h = self.attn(h, meta, k_cache, v_cache)
        h, residual = K.add_rms_norm(h, residual, self.post_attention_norm, self.eps)
        return self.mlp(h), residual


class LayerLoop(Protocol):
    """Every layer of a step in one call, for the steps it ``applies`` to: what ``Transformer`` asks of
    the C++ decode loop (``backends.cpu.decode_loop.DecodeLoop``), which is built from the model."""

    def applies(self, meta: AttentionMetadata, rows: int) -> bool: ...

    def run(self, x: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]: ...


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kernels: KernelSet = reference) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.kernels = kernels
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, dtype, kernels) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype))
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype
        )
        # The output projection, (hidden, weight) -> logits; use_invariant_kernels swaps it.
        self.head_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.nn.functional.linear
        self.deterministic = False
        # The C++ loop over layers for the decode steps it applies to (backends/cpu/decode_loop.py, put
        # here by the decode_loop load pass); None: every step runs the layers below in Python.
        self.decode_loop: LayerLoop | None = None
        # The tensors load_weights left to the quantise pass (the file's blocks): their dense weights are unread.
        self.absent_weights: frozenset[str] = frozenset()

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_index: torch.Tensor,
    ) -> torch.Tensor:
        # Only the rows whose logits were asked for go through the final norm and
        # the (large) output projection.
        h = self.hidden_states(input_ids, meta, kv_caches, logits_index)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return self.head_linear(h, head).float()

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states (after the final norm) of the batch rows ``rows`` (None: every row).

        ``kv_caches`` None runs without a cache, for a batch of fresh prefills
        only (``meta`` with no decode rows): what embeddings need, leaving the
        paged cache of running sequences untouched.
        """
        x = self.embed(input_ids)
        loop = self.decode_loop
        if loop is not None and kv_caches is not None and loop.applies(meta, x.shape[0]):
            x, residual = loop.run(x, meta, kv_caches)
        else:
            residual = None
            caches = kv_caches if kv_caches is not None else [(None, None)] * len(self.layers)
            for layer, (k_cache, v_cache) in zip(self.layers, caches):
                x, residual = layer(x, residual, meta, k_cache, v_cache)
        if rows is not None:
            x = x.index_select(0, rows)
            residual = residual.index_select(0, rows)
        h, _ = self.kernels.add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return h

    def use_paged_attention(self, fn: PagedAttention) -> None:
        """Run decode steps' attention with ``fn`` (same contract as the reference). The decode loop,
        which calls the C++ kernels itself, is dropped: every step runs ``fn`` then."""
        self.decode_loop = None
        for layer in self.layers:
            layer.attn.paged_attention = fn

    def use_kernels(self, kernels: KernelSet) -> None:
        """Run every op with the kernel set ``kernels``, its paged attention included."""
        self.kernels = kernels
        for layer in self.layers:
            layer.kernels = layer.attn.kernels = layer.mlp.kernels = kernels
        self.use_paged_attention(kernels.paged_attention)

    def use_invariant_kernels(self, kernels: KernelSet) -> None:
        """Deterministic mode: batch-invariant kernels everywhere (``kernels.cpu.invariant``).

        Norms, attention (one path for every query, see ``Attention.one_path``), every dense
        projection and the output head then compute each row in an order that no other row
        of the batch can change, so a request's logits are the same bits alone or batched.
        """
        self.use_kernels(kernels)
        for layer in self.layers:
            layer.attn.one_path = True
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.forward = kernels.linear_module(module)  # type: ignore[method-assign]
        self.head_linear = kernels.linear
        self.deterministic = True

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, np.ndarray]], absent: Collection[str] = ()) -> None:
        """Copy canonical (Hugging Face named) tensors in, fused as backends/models/layout.py says.
        ``absent``: the tensors left out of the stream because the quantise pass puts the file's
        blocks in their place; their weights stay as allocated, never written nor read.

        An optional bias the checkpoint carries becomes the projection's ``bias`` here
        (``nn.Linear`` adds it from then on); one it lacks costs nothing. Raises
        ``ValueError`` naming a tensor that is unknown, misshapen or missing.
        """
        self.absent_weights = frozenset(absent)
        for dest, array in layout.assemble(self.cfg, tensors, absent):
            owner, attr = self._slot(dest)
            src = torch.from_numpy(np.ascontiguousarray(array))
            dst = getattr(owner, attr)
            if dst is None:  # an optional bias (the layout allows no other absent destination)
                setattr(owner, attr, nn.Parameter(src.to(self.embed.weight.device, self.dtype)))
            elif dst.shape != src.shape:
                raise ValueError(f"{dest.names[0]}: shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
            else:
                dst.copy_(src)

    def truncated(self, num_layers: int) -> Transformer:
        """The first ``num_layers`` layers with this model's final norm and head (a
        self-draft), sharing every weight, the optional biases this model has included."""
        with torch.device("meta"):
            head = type(self)(dataclasses.replace(self.cfg, num_layers=num_layers), self.dtype, self.kernels)
        # Modules a load pass put in place of nn.Linear / nn.Embedding (quantised blocks:
        # backends/cpu/passes.py) are shared whole, with the head function that reads them.
        def replaced(m: nn.Module | None) -> bool:
            return m is not None and not isinstance(m, (nn.Linear, nn.Embedding))

        if replaced(self.embed):
            head.embed = self.embed
        if replaced(self.lm_head):
            head.lm_head = self.lm_head
        for mine, theirs in zip(head.layers, self.layers):
            for parent, other in ((mine.attn, theirs.attn), (mine.mlp, theirs.mlp)):
                for name in ("qkv", "o_proj", "gate_up", "down"):
                    if replaced(getattr(other, name, None)):
                        setattr(parent, name, getattr(other, name))
        head.head_linear = self.head_linear
        for dest in layout.destinations(head.cfg):
            (owner, attr), (source, _) = head._slot(dest), self._slot(dest)
            if owner is not source:  # else shared whole above
                setattr(owner, attr, getattr(source, attr))
        return head

    def _slot(self, dest: layout.Destination) -> tuple[nn.Module, str]:
        """The module and attribute that hold the weight ``dest`` of the layout."""
        if dest.layer is None:
            model_wide = {"embed": (self.embed, "weight"), "norm": (self, "norm"), "head": (self.lm_head, "weight")}
            return model_wide[dest.role]
        block = self.layers[dest.layer]
        attn, mlp = block.attn, block.mlp
        return {
            "input_norm": (block, "input_norm"), "post_attention_norm": (block, "post_attention_norm"),
            "qkv": (attn.qkv, "weight"), "qkv_bias": (attn.qkv, "bias"),
            "o_proj": (attn.o_proj, "weight"), "o_proj_bias": (attn.o_proj, "bias"),
            "q_norm": (attn, "q_norm"), "k_norm": (attn, "k_norm"),
            "gate_up": (mlp.gate_up, "weight"), "gate_up_bias": (mlp.gate_up, "bias"),
            "down": (mlp.down, "weight"), "down_bias": (mlp.down, "bias"),
        }[dest.role]
