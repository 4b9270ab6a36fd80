"""The argument checks the Triton and Metal kernel sets share (kernels/contracts.py).

Pure shape and dtype logic, so it runs on any machine; the kernel sets' own tests check
that each set calls these checks (tests/kernels/test_kernels_triton.py,
tests/backends/metal/test_metal_backend.py).
"""

from __future__ import annotations

import pytest
import torch

from inferflux.kernels.contracts import PagedAttentionShape, check_float, check_paged_attention, check_store_kv
from inferflux.kernels.errors import KernelError


def attention_args(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Two sequences, 3 queries each, 4 heads over 2 KV heads of 8 dims, 5 blocks of 4."""
    q = torch.zeros(2, 3, 4, 8, dtype=dtype)
    k_cache = torch.zeros(2, 5, 4, 8, dtype=dtype)
    tables = torch.tensor([[0, 1], [2, 3]])
    return [q, k_cache, k_cache.clone(), tables, torch.tensor([5, 7]), torch.tensor([2, 4])]


def test_a_good_call_gives_its_sizes() -> None:
    shape = check_paged_attention(*attention_args(torch.bfloat16))
    assert shape == PagedAttentionShape(num_seqs=2, q_len=3, heads=4, head_dim=8, kv_heads=2, num_blocks=5,
                                        block_size=4, max_blocks=2)
    assert shape.group == 2
    q, k_cache, v_cache, tables, lens, starts = attention_args()
    check_paged_attention(q, k_cache, v_cache, tables.int(), lens.int(), starts)  # int32 indices too


@pytest.mark.parametrize("position,replacement,message", [
    (0, torch.zeros(2, 3, 4, 8, dtype=torch.float16), "share a dtype"),
    (0, torch.zeros(6, 4, 8), r"q must be \[num_seqs, q_len, heads, head_dim\]"),
    (2, torch.zeros(2, 5, 4, 16), "caches must be two alike"),
    (0, torch.zeros(2, 3, 4, 16), "q head_dim 16 but cache head_dim 8"),
    (0, torch.zeros(2, 3, 3, 8), "3 query heads is not a multiple of KV heads"),
    (3, torch.tensor([[0, 1]]), r"block_tables \(1, 2\) for 2 sequences"),
    (4, torch.tensor([5]), "must both be \\[2\\]"),
    (5, torch.tensor([[2], [4]]), "must both be \\[2\\]"),
    (3, torch.tensor([[0.0, 1.0], [2.0, 3.0]]), "block_tables must be int32 or int64"),
    (4, torch.tensor([5, 7], dtype=torch.int16), "context_lens must be int32 or int64"),
])
def test_paged_attention_refusals(position: int, replacement: torch.Tensor, message: str) -> None:
    args = attention_args()
    args[position] = replacement
    with pytest.raises(KernelError, match=f"paged_attention: .*{message}"):
        check_paged_attention(*args)


def test_store_kv_refusals() -> None:
    k_cache = torch.zeros(2, 5, 4, 8)
    v_cache = torch.zeros_like(k_cache)
    k = torch.zeros(3, 2, 8)
    check_store_kv(k_cache, v_cache, k, k, torch.tensor([0, 5, -1]))
    with pytest.raises(KernelError, match=r"do not match \(2, 2, 8\) for caches \(2, 5, 4, 8\)"):
        check_store_kv(k_cache, v_cache, k, k, torch.tensor([0, 5]))
    with pytest.raises(KernelError, match="do not match"):
        check_store_kv(k_cache, v_cache, k, k, torch.tensor(0))  # slots must be 1-D
    with pytest.raises(KernelError, match="slots must be int32 or int64"):
        check_store_kv(k_cache, v_cache, k, k, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(KernelError, match="caches must be two alike"):
        check_store_kv(k_cache, v_cache[:1], k, k, torch.tensor([0, 5, -1]))
    with pytest.raises(KernelError, match="share a dtype"):
        check_store_kv(k_cache, v_cache, k.half(), k, torch.tensor([0, 5, -1]))


def test_float_dtypes() -> None:
    check_float("f", torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16))
    with pytest.raises(KernelError, match="f: unsupported dtype torch.float64"):
        check_float("f", torch.zeros(1, dtype=torch.float64))


def test_kernel_errors_are_value_errors() -> None:
    # Callers that already treat bad input as a ValueError (the CLI's model loading) keep doing so.
    assert issubclass(KernelError, ValueError)
