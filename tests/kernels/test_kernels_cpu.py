"""The CPU backend's compiled paged attention against an independent oracle and the reference.

The kernel is built for real (a C++ compiler and ninja are part of the CPU
install); only a machine with no compiler at all skips these tests, and says so.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from inferflux.kernels import cpu as cpu_kernels
from inferflux.kernels import reference as R

if shutil.which("c++") is None:  # pragma: no cover - every supported install has one
    pytest.skip("no C++ compiler on PATH: the CPU kernels cannot be built here", allow_module_level=True)

# The first run on a machine compiles the kernel (~30 s; later runs load it from
# torch's extension cache), too long for the fast tier (tests/conftest.py).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kernel() -> object:
    module = cpu_kernels.load()
    assert module is not None, f"the CPU kernels failed to build: {cpu_kernels.load_error()}"
    return module


def oracle(q, k_cache, v_cache, tables, lens, starts, scale):
    """Attention one query at a time over positions looked up block by block, in float64."""
    num_seqs, q_len, heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(num_seqs):
        for j in range(q_len):
            visible = min(int(starts[s]) + j + 1, int(lens[s]))
            positions = range(visible)
            for h in range(heads):
                kvh = h // group
                keys = torch.stack([k_cache[kvh, tables[s, t // block_size], t % block_size] for t in positions])
                values = torch.stack([v_cache[kvh, tables[s, t // block_size], t % block_size] for t in positions])
                weights = torch.softmax(keys.double() @ q[s, j, h].double() * scale, dim=0)
                out[s, j, h] = weights @ values.double()
    return out


def make_case(seed, *, num_seqs, q_len, heads, kv_heads, head_dim, block_size, dtype, num_blocks=64):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    lens = torch.randint(q_len, 6 * block_size, (num_seqs,), generator=g)
    lens[0] = q_len  # the shortest context: only the new tokens
    if num_seqs > 1:
        lens[1] = 2 * block_size  # ends exactly on a block boundary
    starts = lens - q_len
    max_blocks = int((lens.max() + block_size - 1) // block_size) + 1  # one padding column at least
    # Physical blocks scattered over the cache, distinct per sequence; padding names block 0.
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.long)
    used = 0
    for s in range(num_seqs):
        n = int((lens[s] + block_size - 1) // block_size)
        tables[s, :n] = perm[used : used + n]
        used += n
    q = torch.randn(num_seqs, q_len, heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, lens, starts


SHAPES = [
    # num_seqs, q_len, heads, kv_heads, head_dim, block_size
    (5, 1, 9, 3, 64, 16),  # SmolLM2-135M's attention shape, decode
    (3, 4, 8, 2, 32, 4),  # several new tokens per sequence (speculative verification)
    (4, 1, 4, 4, 48, 8),  # no GQA, a head_dim that is no multiple of 16
    (2, 3, 12, 1, 16, 16),  # multi-query attention
    (1, 17, 9, 3, 64, 16),  # a k = 16 draft being verified
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_float32_matches_the_oracle_and_the_reference(kernel, shape) -> None:
    num_seqs, q_len, heads, kv_heads, head_dim, block_size = shape
    case = make_case(1, num_seqs=num_seqs, q_len=q_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     block_size=block_size, dtype=torch.float32)
    scale = head_dim**-0.5
    got = kernel.paged_attention(*case, scale)
    assert got.shape == case[0].shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), oracle(*case, scale), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, R.paged_attention(*case, scale), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_bfloat16_is_the_float_result_rounded(kernel, shape) -> None:
    num_seqs, q_len, heads, kv_heads, head_dim, block_size = shape
    case = make_case(2, num_seqs=num_seqs, q_len=q_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     block_size=block_size, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    got = kernel.paged_attention(*case, scale)
    assert got.dtype == torch.bfloat16
    # Float32 arithmetic inside, one rounding to bfloat16 at the end: within a
    # bfloat16 step of the exact answer (the reference rounds its scores and
    # probabilities to bfloat16 too, so it is compared more loosely).
    torch.testing.assert_close(got.double(), oracle(*case, scale), atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got.float(), R.paged_attention(*case, scale).float(), atol=3e-2, rtol=3e-2)


def test_the_python_wrapper_takes_the_reference_arguments(kernel) -> None:
    case = make_case(3, num_seqs=2, q_len=1, heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    mask = R.attention_mask(case[4], case[5], 1, case[3].shape[1] * 16, 3)
    got = cpu_kernels.paged_attention(*case, 0.125, mask=mask)
    torch.testing.assert_close(got, R.paged_attention(*case, 0.125, mask=mask), atol=2e-6, rtol=1e-5)


def test_bad_arguments_raise_instead_of_reading_out_of_bounds(kernel) -> None:
    q, k_cache, v_cache, tables, lens, starts = make_case(
        4, num_seqs=2, q_len=1, heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32
    )
    bad_tables = tables.clone()
    bad_tables[1, 0] = k_cache.shape[1]  # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.paged_attention(q, k_cache, v_cache, bad_tables, lens, starts, 0.125)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        kernel.paged_attention(q, k_cache, v_cache, tables[:, :1], lens, starts, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel.paged_attention(q.bfloat16(), k_cache, v_cache, tables, lens, starts, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernel.paged_attention(q[:, :, :8], k_cache, v_cache, tables, lens, starts, 0.125)


def test_the_off_switch_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    with pytest.raises(RuntimeError, match="disabled"):
        cpu_kernels._build()
