"""The batch-invariant kernels of deterministic mode (kernels/cpu/invariant.cpp, the C++ paged
attention as that mode uses it): right within rounding, and the same bits for a row whatever
else shares the call."""

from __future__ import annotations

import shutil

import pytest
import torch

from inferflux.kernels import cpu as cpu_kernels

if shutil.which("c++") is None:  # pragma: no cover - every supported install has one
    pytest.skip("no C++ compiler on PATH: the CPU kernels cannot be built here", allow_module_level=True)

pytestmark = pytest.mark.slow  # the first run on a machine compiles the extension

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def kernel() -> object:
    module = cpu_kernels.load()
    assert module is not None, f"the CPU kernels failed to build: {cpu_kernels.load_error()}"
    return module


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(576, 200), (100, 37), (1536, 64)])  # K: whole chunks, a masked tail, long
def test_linear_rows_do_not_depend_on_the_rest_of_the_batch(kernel, dtype, k, n):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(33, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    full = kernel.invariant_linear(x, w, b)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    tol = 0.02 * exact.abs().max().item() if dtype == torch.bfloat16 else 1e-4 * k**0.5
    assert (full.double() - exact).abs().max().item() <= tol
    for rows in (slice(0, 1), slice(5, 6), slice(32, 33), slice(3, 10), slice(1, 30)):
        assert torch.equal(kernel.invariant_linear(x[rows], w, b), full[rows]), rows
    # Another batch around the same row: its neighbours change, its bits do not.
    other = torch.cat([torch.randn(6, k, generator=g).to(dtype), x[7:8], torch.randn(2, k, generator=g).to(dtype)])
    assert torch.equal(kernel.invariant_linear(other, w, b)[6], full[7])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_do_not_depend_on_the_rest_of_the_batch(kernel, dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 576, generator=g).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    out = kernel.invariant_rms_norm(x, weight, 1e-5)
    xf = x.double()
    exact = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    assert (out.double() - exact).abs().max().item() <= (0.05 if dtype == torch.bfloat16 else 1e-4)
    for rows in (slice(0, 1), slice(17, 18), slice(8, 31)):
        assert torch.equal(kernel.invariant_rms_norm(x[rows], weight, 1e-5), out[rows])


def test_bad_arguments_are_refused(kernel):
    x, w = torch.zeros(2, 8), torch.zeros(3, 8)
    with pytest.raises(RuntimeError, match="differ in K"):
        kernel.invariant_linear(x, torch.zeros(3, 7))
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel.invariant_linear(x, w.bfloat16())
    with pytest.raises(RuntimeError, match="bias must be"):
        kernel.invariant_linear(x, w, torch.zeros(4))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.invariant_linear(x.double(), w.double())
    with pytest.raises(RuntimeError, match="weight must be"):
        kernel.invariant_rms_norm(x, torch.zeros(7), 1e-5)


def test_attention_of_a_query_is_one_computation_in_prefill_chunk_and_decode(kernel):
    """What the model sends through the kernel in deterministic mode: a 12-token prompt attended at once,
    as chunks of 5 + 7 and token by token, alone or next to another sequence, gives each query the same bits."""
    g = torch.Generator().manual_seed(7)
    kv_heads, heads, head_dim, block_size, n = 3, 9, 64, 4, 12
    k_cache = torch.randn(kv_heads, 16, block_size, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(kv_heads, 16, block_size, head_dim, generator=g).bfloat16()
    q = torch.randn(1, n, heads, head_dim, generator=g).bfloat16()
    table = torch.tensor([[5, 2, 9]])

    def attend(queries, start, tables=table, lens=None):
        lens = torch.tensor([start + queries.shape[1]]) if lens is None else lens
        return kernel.paged_attention(queries, k_cache, v_cache, tables, lens, torch.tensor([start]), 0.125)

    whole = attend(q, 0)[0]
    chunks = torch.cat([attend(q[:, :5], 0)[0], attend(q[:, 5:], 5)[0]])
    steps = torch.cat([attend(q[:, j : j + 1], j)[0] for j in range(n)])
    assert torch.equal(whole, chunks) and torch.equal(whole, steps)
    # Beside another sequence (a longer context in other blocks), in one call.
    other = torch.randn(1, n, heads, head_dim, generator=g).bfloat16()
    pair = kernel.paged_attention(torch.cat([other, q]), k_cache, v_cache, torch.tensor([[1, 3, 4], [5, 2, 9]]),
                                  torch.tensor([n, n]), torch.tensor([0, 0]), 0.125)
    assert torch.equal(pair[1], whole)
