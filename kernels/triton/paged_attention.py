"""Causal attention over the paged KV cache (decode, prefill chunks, draft verification).

One program owns one (sequence, KV head, tile of query rows). GQA folds the KV
head's query group into the row axis, as the reference does: row ``r`` is query
``r // group`` of head ``kv_head * group + r % group``, so K/V are read once for
the whole group. The program walks the sequence's context ``BLOCK_N`` positions
at a time, looking each position's physical block up in the block table (so any
block size works), and keeps an online softmax in float32: a running max ``m``,
a running sum ``l`` and the unnormalised output ``acc``, rescaled as the max grows.
Only the context a tile can see is read: up to the last query's position, capped
by the context length.

Split context ("flash decoding"). Few sequences give few programs: a decode step of
one sequence of SmolLM2 is 3 (one per KV head), each walking the whole context, so
the step took ~32 us on an H100 whatever its length (docs/backends.md). When the
grid would leave the GPU's multiprocessors idle, and the step is being captured
as a CUDA graph (where a second launch is free), each program takes an equal share
of its context instead (``splits`` shares), writes its normalised output and its
log-sum-exp in float32, and a second kernel merges the shares, weighting each by
exp2(lse - max lse). The number of shares is chosen on the host from shapes alone
(no read of the context lengths, so CUDA graphs can capture it); each program then
divides its sequence's actual context, so short contexts leave the extra shares
empty rather than unbalanced. The merge changes the summation order, not the
result beyond float32 rounding.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from inferflux.kernels.contracts import check_paged_attention

from ._common import block, check_cache_strides, check_device, interpreting, unit_last_stride

LOG2E = math.log2(math.e)
MAX_BLOCK_M = 64


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        # Triton's interpreter multiplies bfloat16 operands as their uint16 bit
        # patterns (triton-lang/triton#11584). Products of bf16 values are exact in
        # float32, so a float32 product with float32 accumulation is what the GPU's
        # bf16 tensor-core dot computes.
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:  # float32 inputs: no TF32 rounding
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


# Long: a Triton kernel is one program's body, read top to bottom: the query tile loaded, the
# context walked with an online softmax, the output (or its share) stored. Its tiles stay in
# registers across those steps; jitted helpers would only pass them through inlined calls.
@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lens_ptr, starts_ptr, out_ptr,
    part_ptr, lse_ptr,
    scale_log2,
    q_len, group, D, block_size, splits,
    stride_qs, stride_qt, stride_qh,
    stride_os, stride_ot, stride_oh,
    stride_ch, stride_cb, stride_cs,
    stride_bt,
    stride_ps, stride_pseq, stride_pt, stride_ph,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1) // splits
    share = tl.program_id(1) % splits
    tile = tl.program_id(2)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len * group
    j = rows // group  # query index within the sequence
    head = kvh * group + rows % group
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D

    q_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qs + j[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)

    context_len = tl.load(lens_ptr + seq)
    query_start = tl.load(starts_ptr + seq)
    q_pos = query_start + j
    last_j = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // group, q_len - 1)
    hi = tl.minimum(context_len, query_start + last_j + 1)
    lo = hi * 0  # hi's type: the split branch below redefines it
    if SPLIT:  # this program's share of the visible context, whole BLOCK_N steps
        chunk = tl.cdiv(tl.cdiv(hi, splits), BLOCK_N) * BLOCK_N
        lo = share * chunk
        hi = tl.minimum(hi, lo + chunk)

    # A finite starting max: a row that sees nothing in a step keeps exp2(-inf - m) = 0
    # instead of the NaN of (-inf) - (-inf).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    cache_head = k_cache_ptr + kvh.to(tl.int64) * stride_ch
    v_head = v_cache_ptr + kvh.to(tl.int64) * stride_ch
    table = tables_ptr + seq * stride_bt

    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < hi
        # Positions past the context are never loaded: a cache slot there may hold
        # anything (stale or uninitialised memory, NaN included).
        phys = tl.load(table + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
        kv_off = phys * stride_cb + (offs_n % block_size) * stride_cs
        k = tl.load(cache_head + kv_off[None, :] + offs_d[:, None], mask=n_valid[None, :] & d_mask[:, None], other=0.0)
        qk = _dot(q, k, IEEE, UPCAST)
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        qk = tl.where(visible, qk * scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_head + kv_off[:, None] + offs_d[None, :], mask=n_valid[:, None] & d_mask[None, :], other=0.0)
        # Probabilities are rounded to the cache dtype for the product with V, as in
        # the reference (and every flash-attention kernel): a bf16 tensor-core dot.
        pv = _dot(p.to(v.dtype), v, IEEE, UPCAST)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # A row with no visible position (an empty context, or an empty share) returns
    # zeros, not NaN; as a share its log-sum-exp is -inf, so the merge gives it no weight.
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SPLIT:
        row_off = share * stride_ps + seq * stride_pseq + j * stride_pt + head * stride_ph
        tl.store(part_ptr + row_off[:, None] + offs_d[None, :], out, mask=q_mask)
        # The shares are contiguous, so a row's lse sits at its output offset / D (stride_ph).
        tl.store(lse_ptr + row_off // stride_ph, tl.where(seen, m_i + tl.log2(l_i), float("-inf")), mask=row_valid)
    else:
        tl.store(out_ptr + seq * stride_os + j[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_shares_kernel(
    part_ptr, lse_ptr, out_ptr,
    splits, q_len, heads, D,
    stride_ps, stride_pseq, stride_pt, stride_ph,
    stride_os, stride_ot, stride_oh,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (sequence, query, head): the shares' outputs weighted by exp2(lse - max)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq, j = row // q_len, row % q_len
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < splits
    base = seq * stride_pseq + j * stride_pt + head * stride_ph
    lse = tl.load(lse_ptr + (base + offs_s * stride_ps) // stride_ph, mask=s_valid, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weight = tl.where(lse > float("-inf"), tl.exp2(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
    part = tl.load(part_ptr + base + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=s_valid[:, None] & (offs_d[None, :] < D), other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + j * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def tile_sizes(q_rows: int, head_dim: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D) for ``q_rows`` folded query rows per sequence and KV
    head of ``head_dim`` elements of ``elem_bytes`` each."""
    block_m = min(block(q_rows, 16), MAX_BLOCK_M)  # tl.dot wants 16 rows at least
    block_d = block(head_dim, 16)
    # Halve the context step for wide rows: float32 at head_dim 128 with 64 positions
    # needs ~70 KB of shared memory, more than an MI300's 64 KB (compile_check.py).
    block_n = 64 if block_d * elem_bytes <= 256 else 32
    return block_m, block_n, block_d


MAX_SPLITS = 16
# Shares are worth their merge only while the grid leaves a quarter of the multiprocessors
# idle; then aim for two programs a multiprocessor. Measured on an H100 (docs/backends.md):
# 96 programs (SmolLM2, 32 sequences) 32 -> 18 us; 128 (a llama-3-8B prefill chunk) and
# 256 (its 32-sequence decode) were slower split.
PROGRAMS_PER_SM = 2


def choose_splits(programs: int, max_context: int, block_n: int, device: torch.device, capturing: bool) -> int:
    """Shares of each context, from shapes alone. Only inside a CUDA graph capture: there
    the merge kernel's launch costs nothing, while an eager step of a small model is bound
    by launching kernels from Python, and a second launch a layer would cost more than
    the split saves. 1 as well where the grid fills the GPU, or under the interpreter."""
    if device.type != "cuda" or not capturing:
        return 1
    sm = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    if 4 * programs > 3 * sm:
        return 1
    return max(1, min(MAX_SPLITS, -(-PROGRAMS_PER_SM * sm // programs), max_context // (4 * block_n)))


_SM_COUNT: dict[int, int] = {}


def _multiprocessors(index: int) -> int:
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


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
    """``kernels.reference.paged_attention``'s contract; ``mask`` is accepted and ignored
    (the kernel derives causality from ``context_lens`` and ``query_start``)."""
    return _paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start, scale)


def _paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    block_n: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """The launcher; ``block_n`` (context positions per step) and ``splits`` (shares of
    each context, see the module docstring) are for tests and benchmarks."""
    check_device("paged_attention", q, k_cache, v_cache, block_tables, context_lens, query_start)
    shape = check_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start)
    check_cache_strides("paged_attention", k_cache, v_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.numel() == 0:
        return out
    q = unit_last_stride(q)
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    context_lens, query_start = context_lens.contiguous(), query_start.contiguous()
    num_seqs, q_len, group, head_dim = shape.num_seqs, shape.q_len, shape.group, shape.head_dim
    block_m, default_n, block_d = tile_sizes(q_len * group, head_dim, q.element_size())
    block_n = block_n or default_n
    tiles = triton.cdiv(q_len * group, block_m)
    if splits is None:
        max_context = block_tables.shape[1] * shape.block_size
        capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        splits = choose_splits(num_seqs * shape.kv_heads * tiles, max_context, block_n, q.device, capturing)
    if splits > 1:  # float32 shares and their log-sum-exps: [splits, seqs, q_len, heads, (D)]
        part = torch.empty((splits, *q.shape), dtype=torch.float32, device=q.device)
        lse = torch.empty(part.shape[:-1], dtype=torch.float32, device=q.device)
        part_strides = (part.stride(0), part.stride(1), part.stride(2), part.stride(3))
    else:
        part = lse = out  # not read: SPLIT is off
        part_strides = (0, 0, 0, 1)
    grid = (num_seqs, shape.kv_heads * splits, tiles)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, query_start, out,
        part, lse,
        scale * LOG2E,
        q_len, group, head_dim, shape.block_size, splits,
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        *part_strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32, UPCAST=interpreting() and q.dtype != torch.float32,
        SPLIT=splits > 1,
        num_warps=4, num_stages=2,
    )
    if splits > 1:
        _merge_shares(part, lse, out, splits, part_strides, block_d)
    return out


def _merge_shares(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, splits: int,
                  part_strides: tuple[int, int, int, int], block_d: int) -> None:
    """The second launch of a split context: each (sequence, query, head)'s shares merged into ``out``."""
    num_seqs, q_len, heads, head_dim = out.shape
    _merge_shares_kernel[(num_seqs * q_len, heads)](
        part, lse, out,
        splits, q_len, heads, head_dim,
        *part_strides,
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_S=block(splits), BLOCK_D=block_d,
        num_warps=1,
    )
