"""kernels.reference on a device other than the CPU.

The reference runs beside the Triton kernels on a GPU (benchmarks/bench_kernels.py checks
each kernel against it there), so it must build everything on its inputs' device. The
``meta`` device stands in for a GPU here: an op that mixes it with a host tensor raises,
as a CUDA one does.
"""

from __future__ import annotations

import torch

from inferflux.kernels import reference as R


def test_paged_attention_stays_on_its_inputs_device() -> None:
    seqs, q_len, heads, kv_heads, head_dim, block, blocks = 2, 3, 4, 2, 8, 4, 6
    meta = {"device": "meta"}
    q = torch.empty(seqs, q_len, heads, head_dim, **meta)
    k_cache = torch.empty(kv_heads, blocks, block, head_dim, **meta)
    v_cache = torch.empty(kv_heads, blocks, block, head_dim, **meta)
    tables = torch.empty(seqs, 3, dtype=torch.long, **meta)
    lens = torch.empty(seqs, dtype=torch.long, **meta)
    starts = torch.empty(seqs, dtype=torch.long, **meta)

    out = R.paged_attention(q, k_cache, v_cache, tables, lens, starts, head_dim**-0.5)

    assert out.device.type == "meta"
    assert out.shape == (seqs, q_len, heads, head_dim)
    assert R.attention_mask(lens, starts, q_len, 12, heads // kv_heads).device.type == "meta"
