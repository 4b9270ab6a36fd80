"""The fused elementwise kernels (kernels/cpu/fused.cpp; the kernel set kernels.cpu.fast
uses the norm and RoPE) against kernels.reference: RoPE and SiLU times up give the
reference's bits in bfloat16, the norms agree within rounding, and a row's norm does not depend on the rows
around it."""

from __future__ import annotations

import shutil

import pytest
import torch

from inferflux.kernels import cpu as cpu_kernels
from inferflux.kernels import reference as R

if shutil.which("c++") is None:  # pragma: no cover - every supported install has one
    pytest.skip("no C++ compiler on PATH: the CPU kernels cannot be built here", allow_module_level=True)

pytestmark = pytest.mark.slow  # the first run on a machine compiles the extension

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def fast():  # type: ignore[no-untyped-def]
    if cpu_kernels.load() is None:
        pytest.fail(f"the CPU kernels failed to build: {cpu_kernels.load_error()}")
    from inferflux.kernels.cpu import fast

    return fast


def _kernels():  # type: ignore[no-untyped-def]
    """The extension itself, for the kernel the fast set does not use yet (fused_silu_and_mul)."""
    return cpu_kernels.load()


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_the_reference_and_is_batch_invariant(fast, dtype) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    x, res = (torch.randn(7, 579, generator=g).to(dtype) for _ in range(2))  # 579: a tail past 16 lanes
    w = torch.randn(579, generator=g).to(dtype)
    h_ref, r_ref = R.add_rms_norm(x, res, w, 1e-5)
    h, r = fast.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(r, r_ref)  # the residual add rounds as the reference's
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(h.float(), h_ref.float(), rtol=tol, atol=tol)
    alone, _ = fast.add_rms_norm(x[3:4], res[3:4], w, 1e-5)
    assert torch.equal(alone, h[3:4])
    torch.testing.assert_close(fast.rms_norm(x, w, 1e-5).float(), R.rms_norm(x, w, 1e-5).float(),
                               rtol=tol, atol=tol)
    assert torch.equal(fast.rms_norm(x[None], w, 1e-5)[0], fast.rms_norm(x, w, 1e-5))  # any leading shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_on_a_strided_view_equals_the_reference(fast, dtype) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(4, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(4, heads + kv_heads, dim)  # rows strided, as in the model
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    cos, sin = R.rope_cos_sin(torch.tensor([0, 1, 37, 4000]), inv_freq, dtype)
    out = fast.apply_rope(qk, cos, sin)
    ref = R.apply_rope(qk, cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_the_reference(fast, dtype) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    gate_up = (4 * torch.randn(5, 2 * 1536, generator=g)).to(dtype)
    out, ref = _kernels().fused_silu_and_mul(gate_up), R.silu_and_mul(gate_up)
    assert out.shape == (5, 1536)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)


def test_bad_arguments_are_clear_errors(fast) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        _kernels().fused_silu_and_mul(torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="rows, 2 \\* n"):
        _kernels().fused_silu_and_mul(torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="weight must be"):
        fast.add_rms_norm(torch.ones(2, 8), torch.ones(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="cos/sin"):
        fast.apply_rope(torch.ones(2, 3, 8), torch.ones(1, 1, 8), torch.ones(1, 1, 8))
