"""The metal backend: what can be checked anywhere, and the rest on a Mac.

Anywhere: the probe's reason, the shader sources, and that the Python wrappers
marshal each call the way the shaders' own parameter lists (parsed from the
``.metal`` files) expect it: order, kinds, element types and values. The shaders
themselves and the backend end to end need macOS with an Apple GPU; those tests
skip elsewhere and say so.
"""

from __future__ import annotations

import inspect
import platform
import re

import numpy as np
import pytest
import torch

import inferflux.kernels.metal as KM
from inferflux.backends.base import Batch, ModelSpec, SequenceSlice
from inferflux.backends.metal import MetalBackend
from inferflux.kernels import reference as R
from inferflux.kernels.errors import KernelError

MPS_REASON = MetalBackend.probe()
needs_mps = pytest.mark.skipif(MPS_REASON is not None, reason=f"needs macOS with an Apple GPU ({MPS_REASON})")

# One buffer parameter of a shader: address space, const, element type, pointer or reference, name, index.
PARAM = re.compile(r"(device|constant)\s+(const\s+)?(\w+)\s*([*&])\s*(\w+)\s*\[\[\s*buffer\((\d+)\)\s*\]\]")


def shader_params(source: str, kernel: str) -> list[tuple[str, bool, str, str, str]]:
    """``(space, const, type, '*' or '&', name)`` of ``kernel``'s buffers, checked to be indexed 0..n-1."""
    text = (KM.SOURCE_DIR / source).read_text()
    signature = re.search(rf"kernel\s+void\s+{kernel}\s*\((.*?)\)\s*\{{", text, re.S)
    assert signature, f"no kernel {kernel} in {source}"
    found = PARAM.findall(signature.group(1))
    assert [int(p[5]) for p in found] == list(range(len(found))), "buffer indices must run 0..n-1 in order"
    return [(space, bool(const), typ, kind, name) for space, const, typ, kind, name, _ in found]


def shader_constant(source: str, name: str) -> int:
    match = re.search(rf"constexpr\s+uint\s+{name}\s*=\s*(\d+)", (KM.SOURCE_DIR / source).read_text())
    assert match, f"{source} defines no {name}"
    return int(match.group(1))


def check_marshalling(launch: KM.Launch, source: str, kernel: str, names: tuple[str, ...]) -> dict:
    """The launch's arguments fit the shader's parameters one for one; returns them by name."""
    params = shader_params(source, kernel)
    assert (launch.source, launch.kernel) == (source, kernel)
    assert tuple(p[4] for p in params) == names
    assert len(launch.args) == len(params)
    for (space, const, typ, kind, name), arg in zip(params, launch.args):
        if kind == "*":
            assert space == "device" and isinstance(arg, torch.Tensor) and arg.is_contiguous(), name
            assert arg.dtype == {"elem_t": launch.dtype, "int": torch.int32}[typ], name
        elif typ == "long":
            assert space == "constant" and const is False and type(arg) is int, name  # torch passes ints as int64
        else:
            assert (space, typ) == ("constant", "float") and type(arg) is float, name
    return dict(zip(names, launch.args))


def attention_inputs(dtype: torch.dtype, q_len: int = 1, head_dim: int = 16):
    gen = torch.Generator().manual_seed(0)
    seqs, heads, kv_heads, blocks, block_size = 3, 8, 2, 12, 4
    q = torch.randn(seqs, q_len, heads, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(kv_heads, blocks, block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, blocks, block_size, head_dim, generator=gen).to(dtype)
    tables = torch.tensor([[3, 7, 1, 0], [11, 2, 0, 0], [5, 9, 4, 8]])
    lens = torch.tensor([9, 6, 16])
    starts = lens - q_len
    return q, k_cache, v_cache, tables, lens, starts


def test_probe_says_why_not_here():
    from inferflux.backends.registry import probe

    assert probe("metal").reason == MPS_REASON
    if platform.system() != "Darwin":
        assert MPS_REASON == f"Metal needs macOS (this is {platform.system()})"


def test_shader_sources_are_present():
    sources = sorted(p.name for p in KM.SOURCE_DIR.glob("*.metal"))
    assert sources == ["kv_store.metal", "paged_attention.metal"]
    assert shader_constant("paged_attention.metal", "SIMD_WIDTH") == KM.SIMD_WIDTH
    assert shader_constant("paged_attention.metal", "DIMS_PER_THREAD") == KM.DIMS_PER_THREAD
    # Only the outputs are writable buffers.
    written = {name for space, const, _, kind, name in shader_params("paged_attention.metal", "paged_attention")
               if kind == "*" and not const}
    assert written == {"out"}
    written = {name for space, const, _, kind, name in shader_params("kv_store.metal", "store_kv")
               if kind == "*" and not const}
    assert written == {"k_cache", "v_cache"}


def test_kernel_set_has_the_reference_signatures():
    for name in KM.__all__:
        ours, theirs = inspect.signature(getattr(KM, name)), inspect.signature(getattr(R, name))
        assert list(ours.parameters) == list(theirs.parameters), name
        assert [p.default for p in ours.parameters.values()] == [p.default for p in theirs.parameters.values()], name
    assert {"rms_norm", "add_rms_norm", "apply_rope", "silu_and_mul", "store_kv", "paged_attention",
            "causal_attention", "apply_rope_interleaved"} <= set(KM.__all__)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 3])
def test_paged_attention_marshalling(dtype, q_len):
    q, k_cache, v_cache, tables, lens, starts = attention_inputs(dtype, q_len)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a strided view, as the model passes
    launch = KM.paged_attention_launch(q, k_cache, v_cache, tables, lens, starts, 0.25)
    args = check_marshalling(launch, "paged_attention.metal", "paged_attention", KM.PAGED_ATTENTION_PARAMS)
    assert launch.dtype == dtype
    assert torch.equal(args["q"], q) and args["k_cache"] is k_cache and args["v_cache"] is v_cache
    assert torch.equal(args["block_tables"], tables.int()) and torch.equal(args["query_start"], starts.int())
    assert torch.equal(args["context_lens"], lens.int())
    assert args["out"].shape == q.shape and args["out"].dtype == dtype
    assert args["scale"] == 0.25
    assert (args["q_len"], args["heads"], args["kv_heads"], args["head_dim"]) == (q_len, 8, 2, 16)
    assert (args["block_size"], args["num_blocks"], args["max_blocks"]) == (4, 12, 4)
    # One SIMD group per (query row, head): the grid in threadgroups is [1, heads, seqs * q_len].
    assert launch.group_size == (KM.SIMD_WIDTH, 1, 1)
    groups = [t // g for t, g in zip(launch.threads, launch.group_size)]
    assert all(t % g == 0 for t, g in zip(launch.threads, launch.group_size))
    assert groups == [1, 8, 3 * q_len]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_marshalling(dtype):
    kv_heads, head_dim = 2, 16
    k_cache = torch.zeros(kv_heads, 10, 4, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(5, 8 + 2 * kv_heads, head_dim).to(dtype)
    k, v = qkv[:, 8:10], qkv[:, 10:]  # views of a fused projection, as in the model
    slots = torch.tensor([3, 4, 17, 39, 0])
    launch = KM.store_kv_launch(k_cache, v_cache, k, v, slots)
    args = check_marshalling(launch, "kv_store.metal", "store_kv", KM.STORE_KV_PARAMS)
    assert args["k_cache"] is k_cache and args["v_cache"] is v_cache
    assert torch.equal(args["k"], k) and torch.equal(args["v"], v) and torch.equal(args["slots"], slots.int())
    assert (args["kv_heads"], args["num_blocks"], args["block_size"], args["head_dim"]) == (2, 10, 4, 16)
    assert launch.threads == (head_dim, kv_heads, 5)  # one thread per element written


def test_wrappers_refuse_what_the_shaders_cannot_do():
    q, k_cache, v_cache, tables, lens, starts = attention_inputs(torch.float32, head_dim=288)
    with pytest.raises(KernelError, match="head_dim 288"):
        KM.paged_attention_launch(q, k_cache, v_cache, tables, lens, starts, 1.0)
    q, k_cache, v_cache, tables, lens, starts = attention_inputs(torch.float32)
    with pytest.raises(KernelError, match="share a dtype"):
        KM.paged_attention_launch(q.half(), k_cache, v_cache, tables, lens, starts, 1.0)
    with pytest.raises(KernelError, match="contiguous"):
        KM.paged_attention_launch(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), tables, lens, starts, 1.0)
    with pytest.raises(KernelError, match="block_tables"):
        KM.paged_attention_launch(q, k_cache, v_cache, tables[:2], lens, starts, 1.0)
    with pytest.raises(KernelError, match="do not match"):
        KM.store_kv_launch(k_cache, v_cache, q[:, 0, :2], q[:, 0, :2], torch.tensor([0, 1]))


# -- on a Mac ------------------------------------------------------------------------


def mps_dtypes() -> list[torch.dtype]:
    from inferflux.backends.metal.backend import macos_major

    return [torch.float32, torch.float16] + ([torch.bfloat16] if macos_major() >= 14 else [])


@needs_mps
@pytest.mark.parametrize("q_len", [1, 3])
def test_shaders_match_the_reference(q_len):
    for dtype in mps_dtypes():
        q, k_cache, v_cache, tables, lens, starts = attention_inputs(dtype, q_len)
        want = R.paged_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, starts, 0.25)
        got = KM.paged_attention(*(t.to("mps") for t in (q, k_cache, v_cache, tables, lens, starts)), 0.25)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.cpu().float(), want, atol=tol, rtol=tol)

        k = torch.randn(4, 2, 16).to(dtype)
        v = torch.randn(4, 2, 16).to(dtype)
        slots = torch.tensor([5, 0, 47, 22])
        want_k, want_v = k_cache.clone(), v_cache.clone()
        R.store_kv(want_k, want_v, k, v, slots)
        got_k, got_v = k_cache.to("mps"), v_cache.to("mps")
        KM.store_kv(got_k, got_v, k.to("mps"), v.to("mps"), slots.to("mps"))
        assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


@needs_mps
def test_backend_matches_the_cpu_backend():
    """SmolLM2 in float32 on mps against the CPU backend: a prefill, then a mixed step."""
    from inferflux.backends.cpu import CPUBackend
    from inferflux.backends.models import default_model_path

    spec = ModelSpec(name="smollm2", path=default_model_path(), dtype="float32")
    prompts = [list(range(100, 123)), list(range(400, 409)), list(range(700, 741))]
    tables = [[0, 1], [2], [3, 4, 5]]
    step1 = Batch([SequenceSlice(0, prompts[0], 0, tables[0]), SequenceSlice(1, prompts[1], 0, tables[1])], 16)
    step2 = Batch([
        SequenceSlice(0, [7], 23, tables[0]),  # a decode step
        SequenceSlice(1, [8, 9, 10], 9, tables[1], num_logits=3),  # a chunk after cached context
        SequenceSlice(2, prompts[2], 0, tables[2], num_logits=2),  # a fresh prefill
    ], 16)
    results = []
    for backend in (CPUBackend(), MetalBackend()):
        backend.load(spec)
        backend.allocate_kv(8, 16)
        results.append([np.asarray(backend.forward(step)) for step in (step1, step2)])
    for ours, theirs in zip(results[1], results[0]):
        np.testing.assert_allclose(ours, theirs, atol=2e-3, rtol=0)
