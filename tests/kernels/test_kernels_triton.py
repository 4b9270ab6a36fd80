"""The Triton kernel set against kernels.reference and, for attention, a float64 oracle.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set
by tests/conftest.py): the same kernel source, executed with numpy on
the CPU. That proves indexing, masking and arithmetic; the last test compiles every
kernel for an H100 and an MI300 (no device needed), and speed is for
benchmarks/bench_kernels.py on a GPU machine. With a CUDA/ROCm device the same tests run
compiled on it.
"""

from __future__ import annotations

import importlib

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (it ships for Linux only)")

import inferflux.kernels.triton as KT  # noqa: E402  (after conftest.py chose interpreter or GPU)
from inferflux.kernels import reference as R  # noqa: E402
from inferflux.kernels.errors import KernelError  # noqa: E402
from inferflux.kernels.triton import _common as kernels_common  # noqa: E402
from inferflux.kernels.triton.paged_attention import _paged_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO_ROOT = Path(__file__).resolve().parents[2]
EPS = 1e-6


def dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Inputs on the kernels' device. Strided views are taken after the move (``.to``
    would make them contiguous); references run on ``.cpu()`` copies."""
    return [t.to(DEVICE) for t in tensors]


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 result as a kernel's final ``.to(dtype)`` rounds it here: to nearest even
    on a GPU, but toward zero for bfloat16 under Triton's interpreter (its float32 to
    bfloat16 cast drops the low bits)."""
    x = x.float()
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        return (x.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact: low bits are zero
    return x.to(dtype)


def inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


# --- the kernel set's contract ------------------------------------------------------


def test_every_kernel_has_the_reference_signature() -> None:
    assert sorted(KT.__all__) == sorted(
        ["rms_norm", "add_rms_norm", "apply_rope", "apply_rope_interleaved", "silu_and_mul", "store_kv",
         "paged_attention", "causal_attention"]
    )
    for name in KT.__all__:
        ours, theirs = inspect.signature(getattr(KT, name)), inspect.signature(getattr(R, name))
        assert list(ours.parameters) == list(theirs.parameters), name
        assert [p.default for p in ours.parameters.values()] == [p.default for p in theirs.parameters.values()], name
    # Prompt prefill from position 0 stays on PyTorch's SDPA (flash attention on a GPU).
    assert KT.causal_attention is R.causal_attention


# --- norms ---------------------------------------------------------------------------


def norm_inputs(dtype: torch.dtype, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(label, x, weight) on the device."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    return [
        ("rows", randn(7, 576), randn(576)),
        # q-norm on a slice of a fused projection: a strided [tokens, heads, head_dim] view
        ("view", randn(5, 9, 48)[:, 2:6], randn(48)),
        ("4d", randn(2, 3, 4, 80), randn(80)),
        ("one", randn(64), randn(64)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_matches_the_reference(dtype: torch.dtype) -> None:
    for label, x, w in norm_inputs(dtype, 1):
        got = KT.rms_norm(x, w, EPS).cpu()
        want = R.rms_norm(x.cpu(), w.cpu(), EPS)
        assert got.shape == want.shape and got.dtype == dtype, label
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=label)
        else:
            # Both normalise in float32 and round once: at most one bf16 step apart.
            torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=8e-3, msg=label)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_rms_norm_matches_the_reference_and_leaves_its_inputs_alone(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    for label, xd, wd in norm_inputs(dtype, 3):
        (rd,) = dev((torch.randn(xd.shape, generator=g) * 4).to(dtype))
        x, residual, w = xd.cpu(), rd.cpu(), wd.cpu()
        x_before, r_before = x.clone(), residual.clone()
        normed, new_residual = (t.cpu() for t in KT.add_rms_norm(xd, rd, wd, EPS))
        want_normed, want_residual = R.add_rms_norm(x, residual, w, EPS)
        # The residual is the exact float32 sum rounded once to the dtype (bit for bit
        # torch's add on a GPU, within one bf16 step of it under the interpreter).
        assert torch.equal(new_residual, rounded(x.float() + residual.float(), dtype)), label
        if DEVICE != "cpu":
            assert torch.equal(new_residual, want_residual), label
        else:
            torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=8e-3, msg=label)
        # The norm is of the residual as rounded (the reference's order of operations);
        # on a GPU that residual is the reference's own, bit for bit.
        if dtype == torch.float32:
            torch.testing.assert_close(normed, want_normed, atol=1e-5, rtol=1e-5, msg=label)
        else:
            torch.testing.assert_close(normed.float(), R.rms_norm(new_residual, w, EPS).float(),
                                       atol=1e-2, rtol=8e-3, msg=label)
        assert torch.equal(xd.cpu(), x_before) and torch.equal(rd.cpu(), r_before), label


def test_rms_norm_weight_may_have_another_dtype() -> None:
    x, w = dev(torch.randn(3, 64), torch.randn(64).bfloat16())  # the reference reads it as float32 too
    torch.testing.assert_close(KT.rms_norm(x, w, EPS).cpu(), R.rms_norm(x.cpu(), w.cpu(), EPS), atol=1e-5, rtol=1e-5)


# --- rotary embeddings ---------------------------------------------------------------

ROPE_SHAPES = [
    # tokens, q heads, kv heads, head_dim
    (5, 6, 2, 64),
    (3, 9, 3, 80),  # head_dim whose half (40) is no power of two
    (1, 4, 4, 16),
]


def rope_case(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(tokens * 100 + head_dim)
    # q and k as the CPU model rotates them: one strided view into the fused qkv output.
    (qkv,) = dev(torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g).to(dtype))
    qk = qkv[:, : heads + kv_heads]
    positions = torch.randint(0, 5000, (tokens,), generator=g)  # large angles too
    cos, sin = dev(*R.rope_cos_sin(positions, inv_freq(head_dim), dtype))
    return qk, cos, sin


@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_matches_the_reference_on_strided_views(shape, interleaved: bool, dtype: torch.dtype) -> None:
    qk, cos, sin = rope_case(*shape, dtype)
    assert not qk.is_contiguous() or qk.shape[0] == 1
    ours = KT.apply_rope_interleaved if interleaved else KT.apply_rope
    ref = R.apply_rope_interleaved if interleaved else R.apply_rope
    got = ours(qk, cos, sin).cpu()
    qk, cos, sin = qk.cpu(), cos.cpu(), sin.cpu()
    assert got.shape == qk.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref(qk, cos, sin), atol=1e-6, rtol=1e-6)
    else:
        # The kernel rotates in float32 and rounds once: the float32 reference on the
        # same bf16 inputs, rounded, is within one bf16 step; the all-bf16 reference
        # (three roundings) is looser.
        exact = ref(qk.float(), cos.float(), sin.float())
        torch.testing.assert_close(got.float(), exact, atol=1e-2, rtol=8e-3)
        torch.testing.assert_close(got.float(), ref(qk, cos, sin).float(), atol=4e-2, rtol=2e-2)


# --- SwiGLU ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_and_mul_matches_the_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    cases = [
        torch.randn(3, 2 * 1500, generator=g),  # the intermediate size spans two program tiles
        torch.randn(2, 3, 2 * 96, generator=g),
        torch.randn(6, 2 * 1200 + 10, generator=g),  # rows with a stride of their own, below
    ]
    for i, x in enumerate(cases):
        (xd,) = dev((x * 3).to(dtype))
        xd = xd[:, 10:] if i == 2 else xd
        got = KT.silu_and_mul(xd).cpu()
        x = xd.cpu()
        want = R.silu_and_mul(x)
        assert got.shape == want.shape and got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(got.float(), R.silu_and_mul(x.float()), atol=1e-2, rtol=8e-3)
            torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)


# --- the KV cache -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=str)
def test_store_kv_writes_exactly_the_reference_slots(dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    kv_heads, num_blocks, block_size, head_dim, tokens = 3, 10, 4, 48, 9
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    (qkv,) = dev(torch.randn(tokens, 6 + 2 * kv_heads, head_dim, generator=g).to(dtype))
    k, v = qkv[:, 6 : 6 + kv_heads], qkv[:, 6 + kv_heads :]  # strided views, as in the model
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(slot_dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    R.store_kv(want_k, want_v, k.cpu(), v.cpu(), slots.long())
    got_k, got_v = dev(k_cache, v_cache)
    KT.store_kv(got_k, got_v, k, v, *dev(slots))
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


def test_store_kv_skips_negative_slots() -> None:
    k_cache, v_cache = torch.zeros(2, 4, 4, 16), torch.zeros(2, 4, 4, 16)
    k, v = torch.ones(3, 2, 16), torch.full((3, 2, 16), 2.0)
    got_k, got_v = dev(k_cache, v_cache)
    KT.store_kv(got_k, got_v, *dev(k, v, torch.tensor([5, -1, 10])))
    got_k, got_v = got_k.cpu(), got_v.cpu()
    flat_k, flat_v = got_k.view(2, -1, 16), got_v.view(2, -1, 16)
    assert flat_k[:, [5, 10]].eq(1).all() and flat_v[:, [5, 10]].eq(2).all()
    assert got_k.sum() == 2 * 2 * 16 and got_v.sum() == 2 * 2 * 2 * 16  # nothing else was written


# --- paged attention ---------------------------------------------------------------


def attention_oracle(q, k_cache, v_cache, tables, lens, starts, scale) -> torch.Tensor:
    """float64 attention, one (sequence, head) at a time, over the positions each query sees,
    read slot by slot through the block table."""
    num_seqs, q_len, heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = heads // kv_heads
    k_flat = k_cache.double().reshape(kv_heads, -1, head_dim)
    v_flat = v_cache.double().reshape(kv_heads, -1, head_dim)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(num_seqs):
        n = int(lens[s])
        slots = torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size for p in range(n)])
        q_pos = int(starts[s]) + torch.arange(q_len)
        allowed = torch.arange(n)[None, :] <= q_pos[:, None]  # [q_len, n]; queries past n see all n
        for h in range(heads):
            keys, values = k_flat[h // group, slots], v_flat[h // group, slots]
            scores = (q[s, :, h].double() @ keys.T) * scale
            weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            out[s, :, h] = weights @ values
    return out


def attention_case(seed, *, lens, q_len, heads, kv_heads, head_dim, block_size, dtype, num_blocks=48,
                   starts=None, poison=False):
    """Scattered physical blocks, per-sequence tables of different lengths padded with
    arbitrary valid blocks. ``poison`` fills every cache slot outside all contexts with NaN."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens)
    starts = lens - q_len if starts is None else torch.tensor(starts)
    num_seqs = len(lens)
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g)
    max_blocks = int((lens.max() + block_size - 1) // block_size) + 2
    tables = torch.randint(0, num_blocks, (num_seqs, max_blocks), generator=g)  # padding: any valid block
    perm = torch.randperm(num_blocks, generator=g)
    used = 0
    live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for s in range(num_seqs):
        n = int((lens[s] + block_size - 1) // block_size)
        tables[s, :n] = perm[used : used + n]
        used += n
        for p in range(int(lens[s])):
            live[int(tables[s, p // block_size]) * block_size + p % block_size] = True
    if poison:
        for cache in (k_cache, v_cache):
            cache.view(kv_heads, -1, head_dim)[:, ~live] = float("nan")
    q = torch.randn(num_seqs, q_len, heads, head_dim, generator=g)
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables, lens, starts


ATTENTION_CASES = {
    # decode, GQA 6/2, head_dim 64; contexts ending mid-block, on a block edge, and of one token
    "decode-gqa": dict(lens=[37, 32, 1, 70], q_len=1, heads=6, kv_heads=2, head_dim=64, block_size=16),
    # prefill chunks after cached context (query_start > 0), several blocks of context
    "chunk-gqa": dict(lens=[45, 23], q_len=5, heads=6, kv_heads=2, head_dim=64, block_size=8),
    # non-power-of-two head_dim, no GQA, small blocks
    "dim48": dict(lens=[13, 29, 4], q_len=2, heads=4, kv_heads=4, head_dim=48, block_size=4),
    # head_dim 80, multi-query attention
    "dim80-mqa": dict(lens=[19, 40], q_len=3, heads=5, kv_heads=1, head_dim=80, block_size=16),
    # a long draft: 40 queries x group 3 = 120 folded rows, two row tiles
    "verify-40": dict(lens=[55], q_len=40, heads=6, kv_heads=2, head_dim=32, block_size=16),
    # queries padded to one length: the second sequence's last queries lie past its context
    "padded-queries": dict(lens=[30, 21], q_len=4, heads=6, kv_heads=2, head_dim=32, block_size=8, starts=[26, 19]),
}


def run_case(case, block_n=None):
    q, k_cache, v_cache, tables, lens, starts = case
    scale = q.shape[-1] ** -0.5
    args = dev(q, k_cache, v_cache, tables, lens, starts)
    if block_n is None:
        got = KT.paged_attention(*args, scale)
    else:
        got = _paged_attention(*args, scale, block_n=block_n)
    return got.cpu(), scale


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_paged_attention_float32_matches_the_oracle_and_the_reference(name: str) -> None:
    case = attention_case(10, dtype=torch.float32, **ATTENTION_CASES[name])
    got, scale = run_case(case)
    assert got.shape == case[0].shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), attention_oracle(*case, scale), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, R.paged_attention(*case, scale), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["decode-gqa", "chunk-gqa", "dim80-mqa"])
def test_paged_attention_bfloat16_within_a_stated_tolerance(name: str) -> None:
    case = attention_case(11, dtype=torch.bfloat16, **ATTENTION_CASES[name])
    got, scale = run_case(case)
    assert got.dtype == torch.bfloat16
    # Scores, softmax and the output accumulate in float32; the probabilities are
    # rounded to bf16 before the product with V (as in the reference) and the output
    # once at the end: within about two bf16 steps of the exact answer.
    torch.testing.assert_close(got.double(), attention_oracle(*case, scale), atol=1.5e-2, rtol=1e-2)
    torch.testing.assert_close(got.float(), R.paged_attention(*case, scale).float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", ["decode-gqa", "chunk-gqa"])
def test_paged_attention_online_softmax_over_many_small_steps(name: str) -> None:
    # 16 positions per step: several rescales of the running max and sum per row.
    case = attention_case(12, dtype=torch.float32, **ATTENTION_CASES[name])
    got, scale = run_case(case, block_n=16)
    torch.testing.assert_close(got.double(), attention_oracle(*case, scale), atol=2e-6, rtol=1e-5)


def test_paged_attention_never_reads_past_a_context() -> None:
    # Every slot outside the sequences' contexts (the tails of their last blocks, the
    # padding blocks) is NaN: any read of one would poison the output.
    case = attention_case(13, dtype=torch.float32, poison=True, **ATTENTION_CASES["chunk-gqa"])
    got, scale = run_case(case)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), attention_oracle(*case, scale), atol=2e-6, rtol=1e-5)


def test_paged_attention_takes_strided_queries_and_ignores_mask() -> None:
    q, k_cache, v_cache, tables, lens, starts = attention_case(14, dtype=torch.float32, **ATTENTION_CASES["chunk-gqa"])
    # q as the CPU model passes a prefill chunk: a slice of the rotated qk tensor.
    (fused,) = dev(torch.cat((q, torch.randn(*q.shape[:2], 2, q.shape[-1])), dim=2))
    view = fused[:, :, : q.shape[2]]
    assert not view.is_contiguous()
    scale = 0.125
    nonsense_mask = torch.ones(1, dtype=torch.bool, device=DEVICE)
    got = KT.paged_attention(view, *dev(k_cache, v_cache, tables, lens, starts), scale, mask=nonsense_mask).cpu()
    torch.testing.assert_close(got, R.paged_attention(q, k_cache, v_cache, tables, lens, starts, scale),
                               atol=2e-6, rtol=1e-5)


def test_paged_attention_int32_indices() -> None:
    q, k_cache, v_cache, tables, lens, starts = attention_case(15, dtype=torch.float32, **ATTENTION_CASES["dim48"])
    want = R.paged_attention(q, k_cache, v_cache, tables, lens, starts, 0.2)
    got = KT.paged_attention(*dev(q, k_cache, v_cache, tables.int(), lens.int(), starts.int()), 0.2).cpu()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


# --- argument errors ---------------------------------------------------------------


def test_bad_arguments_raise_kernel_errors() -> None:
    q, k_cache, v_cache, tables, lens, starts = dev(
        *attention_case(16, dtype=torch.float32, **ATTENTION_CASES["decode-gqa"])
    )
    with pytest.raises(KernelError, match="not a multiple of KV heads"):
        KT.paged_attention(q[:, :, :5], k_cache, v_cache, tables, lens, starts, 0.1)
    with pytest.raises(KernelError, match="share a dtype"):
        KT.paged_attention(q.bfloat16(), k_cache, v_cache, tables, lens, starts, 0.1)
    with pytest.raises(KernelError, match="block_tables"):
        KT.paged_attention(q, k_cache, v_cache, tables[:2], lens, starts, 0.1)
    with pytest.raises(KernelError, match="int32 or int64"):
        KT.paged_attention(q, k_cache, v_cache, tables.float(), lens, starts, 0.1)
    with pytest.raises(KernelError, match="do not match"):
        KT.store_kv(k_cache, v_cache, q[:, 0, :2], q[:, 0, :2], torch.arange(3, device=DEVICE))
    with pytest.raises(KernelError, match="weight of shape"):
        KT.rms_norm(q, torch.ones(3, device=DEVICE), EPS)
    with pytest.raises(KernelError, match="odd"):
        KT.apply_rope(torch.ones(2, 2, 5, device=DEVICE), *dev(torch.ones(2, 1, 5), torch.ones(2, 1, 5)))
    with pytest.raises(KernelError, match="not even"):
        KT.silu_and_mul(torch.ones(2, 7, device=DEVICE))


@pytest.mark.skipif(DEVICE != "cpu", reason="tests the CPU-tensor message; this machine has a GPU")
def test_cpu_tensors_without_the_interpreter_are_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    # As if kernels.triton had been imported without TRITON_INTERPRET=1.
    monkeypatch.setattr(kernels_common, "INTERPRETING", False)
    with pytest.raises(KernelError, match="need a CUDA or ROCm device.*TRITON_INTERPRET=1"):
        KT.rms_norm(torch.ones(2, 8), torch.ones(8), EPS)


# --- compilation for real GPUs --------------------------------------------------------


def test_every_kernel_compiles_for_cuda_and_rocm_without_a_gpu() -> None:
    # The interpreter checks the arithmetic, not that Triton compiles the kernels; its
    # compiler needs no device, so each kernel is built down to an H100 cubin and an
    # MI300 hsaco here (in a fresh process: this one defined the kernels interpreted).
    # `python -m kernels.triton.compile_check` without --quick covers every tile config.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "inferflux.kernels.triton.compile_check", "--quick", "--target", "cuda:90",
         "--target", "hip:gfx942"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    for kernel in ("_rms_norm_kernel[bf16; BLOCK_D=4096, ADD_RESIDUAL=False]",
                   "_rms_norm_kernel[bf16; BLOCK_D=4096, ADD_RESIDUAL=True]", "_rope_kernel", "_silu_and_mul_kernel",
                   "_store_kv_kernel", "_paged_attention_kernel"):
        for target in ("cuda:90", "hip:gfx942"):
            assert any(line.startswith(f"ok   {target}") and kernel in line for line in report.splitlines()), (
                kernel, target, report)


@pytest.mark.parametrize("name", ["decode-gqa", "chunk-gqa", "verify-40", "padded-queries", "dim80-mqa"])
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_paged_attention_split_context_matches_the_oracle(name: str, splits: int) -> None:
    # Shares of 16 positions: several shares per context, some empty (a 1-token context,
    # a chunk's early rows), each merged by its log-sum-exp.
    case = attention_case(13, dtype=torch.float32, **ATTENTION_CASES[name])
    q, k_cache, v_cache, tables, lens, starts = case
    scale = q.shape[-1] ** -0.5
    got = _paged_attention(*dev(q, k_cache, v_cache, tables, lens, starts), scale, block_n=16, splits=splits).cpu()
    torch.testing.assert_close(got.double(), attention_oracle(*case, scale), atol=2e-6, rtol=1e-5)


def test_paged_attention_split_context_bfloat16() -> None:
    case = attention_case(14, dtype=torch.bfloat16, **ATTENTION_CASES["decode-gqa"])
    q, k_cache, v_cache, tables, lens, starts = case
    scale = q.shape[-1] ** -0.5
    got = _paged_attention(*dev(q, k_cache, v_cache, tables, lens, starts), scale, block_n=16, splits=3).cpu()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), attention_oracle(*case, scale), atol=1.5e-2, rtol=1e-2)


def test_split_count_fills_the_gpu_from_shapes_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    PA = importlib.import_module("inferflux.kernels.triton.paged_attention")  # the package exports the function of that name
    monkeypatch.setitem(PA._SM_COUNT, 0, 132)
    gpu = torch.device("cuda", 0)
    assert PA.choose_splits(3, 8192, 64, gpu, True) == PA.MAX_SPLITS  # one sequence of 3 KV heads, long table
    assert PA.choose_splits(3, 256, 64, gpu, True) == 1  # a short table: shares of fewer than 4 steps are not worth it
    assert PA.choose_splits(96, 8192, 64, gpu, True) == 3  # 32 sequences: 264 programs wanted
    assert PA.choose_splits(128, 8192, 64, gpu, True) == 1  # nearly a program per multiprocessor already
    assert PA.choose_splits(3, 8192, 64, gpu, False) == 1  # an eager step: the merge's launch would cost more
    assert PA.choose_splits(3, 8192, 64, torch.device("cpu"), True) == 1  # the interpreter: never split unasked
