"""kernels/cpu/qmatmul.cpp against gguf's own dequantiser and a float matmul, and its batch invariance.

The kernel quantises each activation row to int8 blocks of 32 (as llama.cpp does), so
it differs from ``x @ dequantised(W).T`` by that rounding: the bound below is a few
activation quantisation steps' worth, far under what a wrong block layout gives
(that is off by the order of the result itself).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from inferflux.kernels import cpu as cpu_kernels

if shutil.which("c++") is None:  # pragma: no cover - every supported install has one
    pytest.skip("no C++ compiler on PATH: the CPU kernels cannot be built here", allow_module_level=True)

pytestmark = pytest.mark.slow  # the first run on a machine compiles the kernels
QTYPES = [T.Q4_0, T.Q4_1, T.Q8_0]
N, K = 80, 576  # K as the default model's hidden size: 18 blocks


@pytest.fixture(scope="module")
def kernel() -> object:
    module = cpu_kernels.load()
    assert module is not None, f"the CPU kernels failed to build: {cpu_kernels.load_error()}"
    return module


def _weights(qtype: T, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    blocks = quantize(w, qtype)
    return torch.from_numpy(blocks), dequantize(blocks, qtype)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_bit_for_bit(kernel: object, qtype: T) -> None:
    blocks, ref = _weights(qtype)
    got = cpu_kernels.dequantize_blocks(blocks, int(qtype), K, False)
    assert np.array_equal(got.numpy(), ref)
    as_bf16 = cpu_kernels.dequantize_blocks(blocks, int(qtype), K, True)
    assert torch.equal(as_bf16, torch.from_numpy(ref).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_qmatmul_matches_dequantised_float_matmul(kernel: object, qtype: T, dtype: torch.dtype) -> None:
    blocks, ref_w = _weights(qtype, seed=1)
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = cpu_kernels.qmatmul(x, blocks, int(qtype))
    ref = x.double() @ torch.from_numpy(ref_w).double().T
    assert got.dtype == torch.float32 and got.shape == (9, N)
    # Per element: |x| max / 127 / 2 of rounding on each of K inputs, weights of ~1:
    # the bound is ~4 standard deviations of that error's sum.
    step = x.float().abs().reshape(9, -1, 32).amax(-1).max() / 127
    bound = 4 * float(step) / 2 * (K / 3) ** 0.5 * float(np.abs(ref_w).mean() * 1.5)
    err = (got.double() - ref).abs().max().item()
    assert err < bound, (err, bound)
    assert err < 0.05 * ref.abs().max().item()


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_a_rows_result_is_the_same_bits_whatever_the_batch(kernel: object, qtype: T) -> None:
    blocks, _ = _weights(qtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    row = torch.randn(1, K, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    alone = cpu_kernels.qmatmul(row, blocks, int(qtype))[0]
    for m, at in ((7, 0), (7, 5), (33, 12), (33, 32)):  # in the groups of four and in the remainder
        batch = torch.randn(m, K, generator=gen).to(torch.bfloat16)
        batch[at] = row[0]
        got = cpu_kernels.qmatmul(batch, blocks, int(qtype))[at]
        assert torch.equal(got, alone), (m, at)


def test_bad_arguments_are_refused(kernel: object) -> None:
    blocks, _ = _weights(T.Q4_1)
    x = torch.randn(2, K)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        cpu_kernels.qmatmul(x, blocks, 12)  # Q4_K: no kernel
    with pytest.raises(RuntimeError, match="bytes a row"):
        cpu_kernels.qmatmul(torch.randn(2, K - 32), blocks, int(T.Q4_1))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_kernels.qmatmul(torch.randn(2, 40), blocks, int(T.Q4_1))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernels.qmatmul(x.double(), blocks, int(T.Q4_1))
