"""Pure PyTorch kernels: the CPU backend's compute path and the oracle that every
accelerator kernel (Triton, MLX, Metal) is tested against.

Layout conventions shared by every backend:
- activations are token-major: ``[num_tokens, num_heads, head_dim]``;
- the paged KV cache of one layer is ``[num_kv_heads, num_blocks, block_size, head_dim]``
  (KV-head major, so a gathered context is contiguous per head); a token's *slot* is
  ``block_table[pos // block_size] * block_size + pos % block_size``;
- RoPE rotates the two halves of each head (Hugging Face's ``rotate_half``); GGUF
  llama weights are un-permuted at load time so one convention serves every model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 whatever the activation dtype: bf16 variance loses too
    # much precision over a 576..4096-wide row.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` then normalise it; returns (normalised, new residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[num_tokens, 1, head_dim]`` for the given positions.

    Angles are formed in float64: at positions in the thousands float32 angles are
    off by more than bf16 can hide.
    """
    freqs = positions.double()[:, None] * inv_freq.double()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding on ``[num_tokens, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Adjacent-pair rotary embedding (GGML's "normal" mode), same cos/sin tables.

    Pair ``(2i, 2i+1)`` is rotated by the angle of frequency ``i``; this is what
    llama.cpp applies to its permuted llama weights.
    """
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1)
    return out.flatten(-2)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write new keys/values ``[num_tokens, kv_heads, head_dim]`` into their slots."""
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1))


def context_mask(context_lens: torch.Tensor, query_start: torch.Tensor, q_len: int, max_ctx: int) -> torch.Tensor:
    """Boolean ``[num_seqs, q_len, max_ctx]``: query ``j`` of a sequence, at position
    ``query_start + j``, sees context positions up to its own and below the length."""
    # On the lengths' own device: the reference also runs beside the Triton kernels on a GPU.
    kv_pos = torch.arange(max_ctx, device=context_lens.device)
    q_pos = query_start[:, None] + torch.arange(q_len, device=query_start.device)[None, :]
    return (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < context_lens[:, None, None])


def attention_mask(
    context_lens: torch.Tensor, query_start: torch.Tensor, q_len: int, max_ctx: int, group: int
) -> torch.Tensor:
    """``[num_seqs, q_len * group, max_ctx]``, True where attention is *forbidden*,
    with rows ordered as ``paged_attention`` folds query groups."""
    return ~context_mask(context_lens, query_start, q_len, max_ctx).repeat_interleave(group, dim=1)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a group of sequences over their paged context.

    q:            ``[num_seqs, q_len, heads, head_dim]`` (queries padded to one length)
    k/v_cache:    ``[kv_heads, num_blocks, block_size, head_dim]``
    block_tables: ``[num_seqs, max_blocks]`` physical blocks of each sequence (padding
                  may name any valid block: it is masked out)
    context_lens: ``[num_seqs]`` valid context length of each sequence
    query_start:  ``[num_seqs]`` position of each sequence's first query token
    mask:         optional ``attention_mask(...)`` result, to build it once for all layers
    Returns ``[num_seqs, q_len, heads, head_dim]``.
    """
    num_seqs, q_len, heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = heads // kv_heads
    max_ctx = block_tables.shape[1] * block_size
    # Whole blocks are gathered (contiguous runs of block_size * head_dim), into a
    # KV-head-major layout so every (head, sequence) context is one contiguous matrix.
    flat = block_tables.reshape(-1)
    k = k_cache.index_select(1, flat).view(kv_heads, num_seqs, max_ctx, head_dim)
    v = v_cache.index_select(1, flat).view(kv_heads, num_seqs, max_ctx, head_dim)
    # GQA without repeating K/V: each KV head's query group joins the query axis.
    qg = q.view(num_seqs, q_len, kv_heads, group, head_dim).permute(2, 0, 1, 3, 4)
    qg = qg.reshape(kv_heads, num_seqs, q_len * group, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    if mask is None:
        mask = attention_mask(context_lens, query_start, q_len, max_ctx, group)
    scores.masked_fill_(mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [kv_heads, num_seqs, q_len * group, head_dim]
    out = out.view(kv_heads, num_seqs, q_len, group, head_dim).permute(1, 2, 0, 3, 4)
    return out.reshape(num_seqs, q_len, heads, head_dim)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention of one sequence with no earlier context.

    q ``[n, heads, head_dim]``, k/v ``[n, kv_heads, head_dim]``; the fast path for a
    prompt prefilled from position 0, which needs no cache read.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return out[0].transpose(0, 1)
