"""exact_linear (kernels/cpu/exact.cpp): the blocks decoded to the loader's weights (bfloat16 or float32, the
activations' dtype), multiplied in invariant_linear's order, so the same bits as invariant_linear on the dense
weights, at any row count. bfloat16 runs where its kernel builds (AVX-512 BF16); float32 on every build (AVX-512F,
AVX2, portable C++), and the slow tier checks each instruction-set level the host can run (kernels.cpu.host_isas).
The K types (Q4_K, Q6_K: kernels/cpu/exact_core.cpp, on every build) take float32 rows; their blocks are
random but valid super-blocks (gguf cannot quantise them), decoded by the loader's numpy dequantisers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from inferflux.backends.cpu.linear import QuantEmbedding, QuantLinear
from inferflux.backends.models.quants import dequantize, random_k_blocks
from inferflux.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ CPU kernels are not built here")

WHY_NOT = {torch.bfloat16: "AVX-512 BF16", torch.float32: "a C++ compiler"}
DTYPES = [
    pytest.param(dtype, marks=pytest.mark.skipif(
        cpu_kernels.load() is None or not cpu_kernels.exact_linear_supported(dtype),
        reason=f"exact_linear on {dtype} rows needs the kernels built with {need}, which this CPU lacks"))
    for dtype, need in WHY_NOT.items()
]  # fmt: skip

QTYPES = {2: GGMLQuantizationType.Q4_0, 3: GGMLQuantizationType.Q4_1, 8: GGMLQuantizationType.Q8_0}
K_TYPES = {12: GGMLQuantizationType.Q4_K, 14: GGMLQuantizationType.Q6_K}
# Decode steps (1-4 rows: the register path), the buffer path's pairs and odd rows, and batches.
K_ROWS = (1, 2, 3, 4, 5, 8, 17, 33, 64)


def _blocks(qtype: int, n: int, k: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights quantised by gguf (random super-blocks for the K types), as blocks and as the loader
    dequantises them (to ``dtype``)."""
    rng = np.random.default_rng(seed)
    if qtype in K_TYPES:
        raw = random_k_blocks(K_TYPES[qtype], n, k, rng)
    else:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        w[0, :32] += 3.0  # one block with a large minimum and scale
        raw = np.ascontiguousarray(quants.quantize(w, QTYPES[qtype])).view(np.uint8).reshape(n, -1)
    dense = torch.from_numpy(dequantize(raw.reshape(-1), qtype, (n, k))).to(dtype)
    return torch.from_numpy(raw.copy()), dense


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", sorted(QTYPES))
@pytest.mark.parametrize(("n", "k"), [(1, 32), (37, 64), (96, 576)])
def test_the_same_bits_as_invariant_linear_on_the_dequantised_weights(
    qtype: int, n: int, k: int, dtype: torch.dtype
) -> None:
    blocks, dense = _blocks(qtype, n, k, seed=n + k + qtype, dtype=dtype)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(qtype)).to(dtype)
    for rows in (1, 2, 3, 4, 5, 9):
        got = cpu_kernels.exact_linear(x[:rows], blocks, qtype)
        assert got.dtype == dtype and got.shape == (rows, n)
        assert torch.equal(got, cpu_kernels.loaded().invariant_linear(x[:rows], dense, None))
    # Batch-invariant: each row alone gives its bits among the others.
    full = cpu_kernels.exact_linear(x, blocks, qtype)
    for i in range(9):
        assert torch.equal(cpu_kernels.exact_linear(x[i : i + 1], blocks, qtype), full[i : i + 1])
    # And it is the product: close to float64's on the same weights.
    want = (x.double() @ dense.double().T).float()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(full.float(), want, rtol=tolerance, atol=tolerance * float(want.abs().max()))


@pytest.mark.parametrize("qtype", sorted(K_TYPES))
@pytest.mark.parametrize(("n", "k"), [(1, 256), (37, 512), (67, 1280)])
def test_k_types_give_invariant_linears_bits_on_the_loaders_weights(qtype: int, n: int, k: int) -> None:
    blocks, dense = _blocks(qtype, n, k, seed=n + k + qtype, dtype=torch.float32)
    assert bool(torch.isfinite(dense).all()) and float(dense.abs().max()) > 0
    x = torch.randn(max(K_ROWS), k, generator=torch.Generator().manual_seed(qtype))
    invariant = cpu_kernels.loaded().invariant_linear
    full = cpu_kernels.exact_linear(x, blocks, qtype)
    for rows in K_ROWS:
        got = cpu_kernels.exact_linear(x[:rows], blocks, qtype)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert torch.equal(got, invariant(x[:rows], dense, None)), rows
        assert torch.equal(got, full[:rows]), rows  # batch-invariant: the same bits in any batch
    for i in (0, 4, 63):
        assert torch.equal(cpu_kernels.exact_linear(x[i : i + 1], blocks, qtype), full[i : i + 1])
    want = (x.double() @ dense.double().T).float()
    assert torch.allclose(full, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", sorted(K_TYPES))
def test_the_dequant_kernel_decodes_k_blocks_to_the_loaders_values(qtype: int) -> None:
    """kernels.cpu.dequantize_blocks (QuantEmbedding's lookups, QuantLinear.dense) gives the numpy
    dequantiser's float32 bits, and those rounded for bfloat16."""
    blocks, dense = _blocks(qtype, 41, 768, seed=qtype, dtype=torch.float32)
    assert torch.equal(cpu_kernels.dequantize_blocks(blocks, qtype, 768, False), dense)
    assert torch.equal(cpu_kernels.dequantize_blocks(blocks, qtype, 768, True), dense.to(torch.bfloat16))
    rows = torch.tensor([3, 0, 40, 3])
    embedding = QuantEmbedding(blocks, qtype, 768, torch.float32)
    assert torch.equal(embedding(rows), dense[rows])


@pytest.mark.parametrize("qtype", sorted(K_TYPES))
def test_a_quant_linear_of_k_blocks_multiplies_exactly(qtype: int) -> None:
    """backends/cpu/linear.py: a QuantLinear of K blocks (the blocks mode: exact_linear at every row count)
    gives invariant_linear's bits on the loader's weights, its bias added after; blocks of the wrong width
    are refused."""
    blocks, dense = _blocks(qtype, 70, 512, seed=3 * qtype, dtype=torch.float32)
    bias = torch.randn(70)
    linear = QuantLinear(blocks, qtype, 512, bias.clone(), gemm_from=1 << 62)
    linear.exact = True
    assert linear.qtype_name == K_TYPES[qtype].name and torch.equal(linear.dense(), dense)
    x = torch.randn(2, 17, 512, generator=torch.Generator().manual_seed(1))
    got = linear(x)
    assert got.shape == (2, 17, 70)
    assert torch.equal(got, (cpu_kernels.loaded().invariant_linear(x.reshape(-1, 512), dense, None) + bias).view(2, 17, 70))
    assert torch.equal(linear(x[1, 5:6]), got[1, 5:6])
    with pytest.raises(ValueError, match="do not hold 512 inputs"):
        QuantLinear(blocks[:, :-1].contiguous(), qtype, 512)
    with pytest.raises(ValueError, match="do not hold 500 inputs"):  # not whole super-blocks
        QuantLinear(blocks, qtype, 500)


@pytest.mark.skipif(cpu_kernels.load() is None or not cpu_kernels.exact_linear_supported(torch.bfloat16),
                    reason="exact_linear on bfloat16 rows needs AVX-512 BF16")
def test_k_blocks_are_refused_for_bfloat16_rows() -> None:
    blocks, _ = _blocks(12, 4, 256, seed=0, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="float32 rows only"):
        cpu_kernels.exact_linear(torch.zeros(1, 256, dtype=torch.bfloat16), blocks, 12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_default_models_own_blocks(dtype: torch.dtype) -> None:
    from inferflux.backends.models import default_model_path
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(default_model_path()).tensors}
    for name in ("blk.0.attn_q.weight", "blk.29.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        n, k, qtype = int(t.shape[1]), int(t.shape[0]), int(t.tensor_type)
        blocks = torch.from_numpy(raw.copy().reshape(n, -1))[:300].contiguous()
        dense = torch.from_numpy(dequantize(raw, qtype, (n, k))).to(dtype)[:300]
        x = torch.randn(3, k).to(dtype)
        assert torch.equal(cpu_kernels.exact_linear(x, blocks, qtype), cpu_kernels.loaded().invariant_linear(x, dense, None))


@pytest.mark.parametrize(("x", "blocks", "qtype", "message"), [
    (torch.zeros(2, 64, dtype=torch.float16), torch.zeros(4, 40, dtype=torch.uint8), 3, "x must be bfloat16 or float32"),
    (torch.zeros(64), torch.zeros(4, 40, dtype=torch.uint8), 3, "x must be bfloat16 or float32"),
    (torch.zeros(2, 48), torch.zeros(4, 30, dtype=torch.uint8), 3, "not a multiple of 32"),
    (torch.zeros(2, 48, dtype=torch.bfloat16), torch.zeros(4, 30, dtype=torch.uint8), 3, "not a multiple of 32"),
    (torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(4, 36, dtype=torch.uint8), 3, "blocks must be"),
    (torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(4, 40, dtype=torch.uint8), 13, "unsupported ggml type"),
    (torch.zeros(2, 64), torch.zeros(4, 40, dtype=torch.uint8), 13, "unsupported ggml type"),  # Q5_K: no kernel
    (torch.zeros(2, 288), torch.zeros(4, 144, dtype=torch.uint8), 12, "not a multiple of 256"),
    (torch.zeros(2, 256), torch.zeros(4, 144, dtype=torch.uint8), 14, "blocks must be"),  # Q4_K's width, not Q6_K's
])
def test_bad_arguments_are_refused(x: torch.Tensor, blocks: torch.Tensor, qtype: int, message: str) -> None:
    # A well-formed x (2-D, a kernel's dtype) is refused for the CPU before anything else is checked;
    # a malformed one is refused as malformed on every CPU.
    if x.dim() == 2 and x.dtype in WHY_NOT and not cpu_kernels.exact_linear_supported(x.dtype):
        message = "needs"
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.exact_linear(x, blocks, qtype)


# The levels whose build differs from the native one here (an AVX2 host's native build is its avx2 level).
LEVELS = [level for level in cpu_kernels.host_isas() if level not in ("auto", cpu_kernels.isa())]


@pytest.mark.slow  # each level is a library of its own, built here on first use (1.5-5 minutes on 2 cores)
@pytest.mark.parametrize("level", LEVELS)
def test_every_level_the_host_runs_gives_the_native_builds_float32_bits(level: str) -> None:
    """The float32 contract on each instruction-set level (kernels/cpu/__init__.py, ISA_ENV): the level's
    exact_linear equals its invariant_linear, and both equal the native build's, bit for bit, at decode and
    batch row counts, for every block type (the K types' portable decoder included); its RMSNorm too. An
    AVX-512 host checks the AVX2 and portable kernels this way."""
    module = cpu_kernels.load(level)
    assert module is not None, cpu_kernels.load_error(level)
    native = cpu_kernels.loaded()
    assert module.build_isa() == (level if level in ("avx512", "avx2") else "generic")
    generator = torch.Generator().manual_seed(7)
    for qtype in sorted(QTYPES) + sorted(K_TYPES):
        k = 768 if qtype in K_TYPES else 576
        blocks, dense = _blocks(qtype, 67, k, seed=qtype, dtype=torch.float32)
        if qtype in K_TYPES:  # the level's own K decoder (AVX2 or portable) for lookups, as exact_linear's
            assert torch.equal(module.dequantize_blocks(blocks, qtype, k, False), dense)
        x = torch.randn(37, k, generator=generator)
        for rows in (1, 2, 3, 8, 37):
            got = module.exact_linear(x[:rows], blocks, qtype)
            assert torch.equal(got, module.invariant_linear(x[:rows], dense, None))
            assert torch.equal(got, native.invariant_linear(x[:rows], dense, None))
            assert torch.equal(got, native.exact_linear(x[:rows], blocks, qtype))
    ragged = torch.randn(5, 50, generator=generator)  # a tail shorter than a chunk
    w = torch.randn(50, generator=generator)
    assert torch.equal(module.invariant_rms_norm(ragged, w, 1e-5), native.invariant_rms_norm(ragged, w, 1e-5))
    wide = torch.randn(7, 50, generator=generator)
    assert torch.equal(module.invariant_linear(ragged, wide, None), native.invariant_linear(ragged, wide, None))
