"""The MLX backend's custom Metal kernel (backends/mlx/metal_kernels.py).

Anywhere: the pure-mx reference against a float64 numpy oracle and against the
built-in decode path it stands in for; the launch parameters and the kernel source
checked against each other; the switch (off by default, off without Metal); the
kernel object built through mx.fast.metal_kernel; and the kernel body itself
compiled with the host C++ compiler behind a thin Metal shim and run, 32 lanes in
lockstep, against the reference; and model.py's wiring, on a tiny random one-layer
model (no model file is loaded). On Apple silicon: the kernel run through Metal.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from inferflux.backends.base import BackendError, Batch, SequenceSlice
from inferflux.backends.models import ModelConfig
from inferflux.backends.models.layout import expected_tensors

# Skipped, saying why, only where mlx is absent (it is a dev dependency on Linux and macOS).
mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'inferflux[mlx]')")
import inferflux.backends.mlx.metal_kernels as MK  # noqa: E402
import inferflux.backends.mlx.model as mlx_model  # noqa: E402
from inferflux.backends.mlx import MLXBackend  # noqa: E402
from inferflux.backends.mlx.model import Transformer, _gather  # noqa: E402

METAL = mx.metal.is_available()
NEEDS_METAL = "needs Apple silicon with Metal (mx.metal.is_available() is False)"

# GQA 6/2, block size 4, ragged contexts (none but 8 a multiple of 4) over a cache of 12 blocks.
HEADS, KV_HEADS, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 4, 12
LENGTHS = [1, 5, 8, 13, 3]
# Each row's blocks, padded to max_blocks = 4 with a *valid* block full of other data,
# so a mask that let padding through would change the answer.
TABLES = [[7, 9, 9, 9], [2, 11, 9, 9], [0, 5, 9, 9], [3, 8, 1, 10], [6, 9, 9, 9]]


def make_inputs(head_dim: int, dtype: mx.Dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((len(LENGTHS), HEADS, head_dim)).astype(np.float32)
    k = rng.standard_normal((KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, head_dim)).astype(np.float32) * 2
    v = rng.standard_normal((KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, head_dim)).astype(np.float32)
    as_mx = lambda a: mx.array(a).astype(dtype)  # noqa: E731
    # The float64 oracle sees exactly the values the mx code sees (after rounding to dtype).
    exact = [np.array(as_mx(a).astype(mx.float32)).astype(np.float64) for a in (q, k, v)]
    args = (as_mx(q), as_mx(k), as_mx(v), mx.array(TABLES, dtype=mx.int32), mx.array(LENGTHS, dtype=mx.int32))
    return args, exact


def oracle(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Position by position through the block tables, in float64."""
    group = HEADS // KV_HEADS
    out = np.zeros_like(q)
    for s, (table, length) in enumerate(zip(TABLES, LENGTHS)):
        slots = [(table[p // BLOCK_SIZE], p % BLOCK_SIZE) for p in range(length)]
        for h in range(HEADS):
            kv = h // group
            keys = np.stack([k[kv, b, o] for b, o in slots])
            values = np.stack([v[kv, b, o] for b, o in slots])
            scores = keys @ q[s, h] * scale
            w = np.exp(scores - scores.max())
            out[s, h] = (w / w.sum()) @ values
    return out


# -- the reference ---------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 40])
def test_reference_matches_float64_oracle(head_dim: int) -> None:
    args, (q, k, v) = make_inputs(head_dim, mx.float32)
    scale = head_dim**-0.5
    got = MK.paged_decode_attention_reference(*args, scale)
    assert got.shape == (len(LENGTHS), HEADS, head_dim) and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), oracle(q, k, v, scale), rtol=1e-5, atol=1e-5)


def test_reference_in_bfloat16_keeps_the_dtype_and_softmax_in_float32() -> None:
    args, (q, k, v) = make_inputs(32, mx.bfloat16, seed=1)
    got = MK.paged_decode_attention_reference(*args, 32**-0.5)
    assert got.dtype == mx.bfloat16
    # Only the final rounding to bf16 (8 bits of mantissa) separates it from the oracle.
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), oracle(q, k, v, 32**-0.5), rtol=1e-2, atol=1e-2)


def test_reference_agrees_with_the_builtin_decode_path() -> None:
    """What model.py computes by default: gather whole blocks, then sdpa under the padded mask."""
    head_dim = 24
    (q, k_cache, v_cache, tables, lengths), _ = make_inputs(head_dim, mx.float32, seed=2)
    visible = np.arange(tables.shape[1] * BLOCK_SIZE)[None, :] < np.array(LENGTHS)[:, None]
    builtin = mx.fast.scaled_dot_product_attention(
        q[:, :, None], _gather(k_cache, tables), _gather(v_cache, tables), scale=head_dim**-0.5,
        mask=mx.array(visible[:, None, None]),
    )[:, :, 0]
    got = MK.paged_decode_attention_reference(q, k_cache, v_cache, tables, lengths, head_dim**-0.5)
    np.testing.assert_allclose(np.array(got), np.array(builtin), rtol=1e-5, atol=1e-5)


def test_reference_refuses_mismatched_inputs() -> None:
    (q, k, v, tables, lengths), _ = make_inputs(16, mx.float32)
    with pytest.raises(BackendError, match="head_dim"):
        MK.paged_decode_attention_reference(q[:, :, :8], k, v, tables, lengths, 1.0)
    with pytest.raises(BackendError, match="rows"):
        MK.paged_decode_attention_reference(q, k, v, tables[:2], lengths, 1.0)
    with pytest.raises(BackendError, match="multiple"):
        MK.paged_decode_attention_reference(q[:, :5], k, v, tables, lengths, 1.0)


# -- launch parameters and source ------------------------------------------------------


def test_launch_is_one_simd_group_per_sequence_and_head() -> None:
    launch = MK.decode_launch(5, 6, 2, 64, 16, 100, mx.bfloat16)
    assert launch.threadgroup == (MK.SIMD_WIDTH, 1, 1) == (32, 1, 1)
    assert launch.grid == (32, 6, 5)  # threads, as mlx dispatches: x lanes, y heads, z sequences
    groups = [g // t for g, t in zip(launch.grid, launch.threadgroup)]
    assert all(g % t == 0 for g, t in zip(launch.grid, launch.threadgroup)) and groups == [1, 6, 5]
    assert launch.output_shapes == [(5, 6, 64)] and launch.output_dtypes == [mx.bfloat16]
    assert dict(launch.template) == {"T": mx.bfloat16, "HEADS": 6, "KV_HEADS": 2, "HEAD_DIM": 64,
                                     "BLOCK_SIZE": 16, "NUM_BLOCKS": 100}
    assert tuple(name for name, _ in launch.template) == MK.TEMPLATE_NAMES


def identifiers(source: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]\w*", re.sub(r"//[^\n]*", "", source)))


def test_source_names_every_input_output_and_template_argument() -> None:
    used = identifiers(MK.SOURCE)
    for name in (*MK.INPUT_NAMES, *MK.OUTPUT_NAMES, *MK.TEMPLATE_NAMES):
        assert name in used, name
    # The attributes mlx adds to the signature because the body names them.
    assert {"threadgroup_position_in_grid", "thread_index_in_simdgroup", "tables_shape"} <= used
    # max_blocks varies per step, so it must come from tables_shape, not a template value
    # (each distinct template value compiles another kernel).
    assert "MAX_BLOCKS" not in used
    # The lanes stride head_dim by the SIMD width the launch uses.
    assert "32 * i" in MK.SOURCE and MK.SIMD_WIDTH == 32
    assert "simd_sum" in used


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 6, 2, 64, 16, 8), "at least one row"),
        ((1, 6, 4, 64, 16, 8), "multiple of kv_heads"),
        ((1, 6, 2, 512, 16, 8), "head_dim 512"),
        ((1, 6, 2, 64, 0, 8), "cache geometry"),
    ],
)
def test_launch_refuses_what_the_kernel_cannot_run(args: tuple, message: str) -> None:
    with pytest.raises(BackendError, match=message):
        MK.decode_launch(*args, mx.float32)


# -- the switch ------------------------------------------------------------------------


def tiny_config() -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=32, hidden_size=48, intermediate_size=64, num_layers=1,
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, context_length=64, tie_word_embeddings=True, attention_bias=False, qk_norm=False,
    )


def test_switch_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MK.ENV_SWITCH, raising=False)
    assert not MK.metal_kernels_enabled()
    assert Transformer(tiny_config(), mx.float32).paged_decode is None
    monkeypatch.setenv(MK.ENV_SWITCH, "true")  # only "1" turns it on
    assert not MK.metal_kernels_enabled()


@pytest.mark.skipif(METAL, reason="checks the behaviour without Metal (this machine has Metal)")
def test_switch_stays_off_without_metal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MK.ENV_SWITCH, "1")
    assert not MK.metal_kernels_enabled()
    assert Transformer(tiny_config(), mx.float32).paged_decode is None


def test_switch_needs_both_metal_and_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MK.mx.metal, "is_available", lambda: True)
    monkeypatch.setenv(MK.ENV_SWITCH, "1")
    assert MK.metal_kernels_enabled()
    monkeypatch.setenv(MK.ENV_SWITCH, "0")
    assert not MK.metal_kernels_enabled()


def test_backend_hands_decode_lengths_that_match_the_builtin_mask() -> None:
    """The kernel's ``lengths`` and the built-in path's mask describe the same positions."""
    backend = MLXBackend()  # nothing loaded: _prepare only needs the cache geometry
    backend.num_blocks = NUM_BLOCKS
    batch = Batch(
        slices=[
            SequenceSlice(seq_id=0, token_ids=[5], start_pos=12, block_table=[3, 8, 1, 10]),
            SequenceSlice(seq_id=1, token_ids=[1, 2, 3], start_pos=0, block_table=[4], num_logits=1),
            SequenceSlice(seq_id=2, token_ids=[7], start_pos=4, block_table=[2, 11]),
        ],
        block_size=BLOCK_SIZE,
    )
    _, meta, _ = backend._prepare(batch)
    d = meta.decode
    assert d.lengths.dtype == mx.int32 and d.lengths.tolist() == [13, 5]
    assert np.array(d.mask).reshape(2, -1).sum(axis=1).tolist() == [13, 5]
    assert d.tables.tolist() == [[3, 8, 1, 10], [2, 11, 0, 0]]


class ReferenceInPlaceOfKernel:
    """Stands where PagedDecodeAttention does, computing with the reference (Linux has no Metal)."""

    calls = 0

    def __call__(self, *args) -> mx.array:
        type(self).calls += 1
        return MK.paged_decode_attention_reference(*args)


def test_model_wiring_feeds_the_kernel_what_the_builtin_path_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the switch on, a tiny random model's logits and caches match the default path's.

    The kernel is replaced by its reference, so this checks model.py's wiring (the
    query rows, the caches after this step's writes, tables, lengths, scale); the
    kernel's own agreement with the reference is the Metal test's job.
    """
    cfg = tiny_config()
    rng = np.random.default_rng(5)
    weights = [(name, (rng.standard_normal(shape) * 0.3).astype(np.float32))
               for name, shape in expected_tensors(cfg)[0].items()]
    monkeypatch.delenv(MK.ENV_SWITCH, raising=False)
    default = Transformer(cfg, mx.float32)
    monkeypatch.setenv(MK.ENV_SWITCH, "1")
    monkeypatch.setattr(MK.mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mlx_model, "PagedDecodeAttention", ReferenceInPlaceOfKernel)
    switched = Transformer(cfg, mx.float32)
    assert default.paged_decode is None and isinstance(switched.paged_decode, ReferenceInPlaceOfKernel)
    for model in (default, switched):
        model.load_weights(weights)

    backend = MLXBackend()  # only for _prepare; the models are called directly
    backend.num_blocks = NUM_BLOCKS
    prefill = Batch([SequenceSlice(0, [1, 2, 3, 4, 5], 0, [3, 8]), SequenceSlice(1, [6, 7], 0, [5])], BLOCK_SIZE)
    # Two decodes (one crossing into a new block) and a prefill chunk after cached context.
    mixed = Batch([SequenceSlice(1, [9, 10, 11], 2, [5, 2]), SequenceSlice(0, [12], 5, [3, 8]),
                   SequenceSlice(2, [13], 0, [7])], BLOCK_SIZE)
    shape = (KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, cfg.head_dim)
    results = []
    for model in (default, switched):
        caches = [(mx.zeros(shape), mx.zeros(shape))]
        for batch in (prefill, mixed):
            ids, meta, rows = backend._prepare(batch)
            logits = model(ids, meta, caches, rows)
            mx.eval(logits, caches)
        results.append((np.array(logits), np.array(caches[0][0]), np.array(caches[0][1])))
    assert ReferenceInPlaceOfKernel.calls == 1  # one layer, one decode group in the mixed step
    for got, want in zip(results[1], results[0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# -- the kernel object -----------------------------------------------------------------


def test_kernel_is_constructed_anywhere() -> None:
    """mx.fast.metal_kernel builds the callable even on mlx's Linux build (no compile yet)."""
    assert callable(MK.PagedDecodeAttention().kernel)


@pytest.mark.skipif(METAL, reason="checks the failure without Metal (this machine has Metal)")
def test_running_the_kernel_without_metal_fails_clearly() -> None:
    args, _ = make_inputs(16, mx.float32)
    with pytest.raises(RuntimeError, match="No Metal back-end"):
        mx.eval(MK.PagedDecodeAttention()(*args, 0.25))


# -- the kernel body on the host, behind a Metal shim ----------------------------------

# Just enough of Metal for the body: address-space qualifiers vanish, and the 32 lanes
# of a SIMD group are 32 host threads meeting at a barrier in simd_sum.
SHIM = r"""
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>
#define device
#define constant
typedef unsigned int uint;
typedef unsigned long ulong;
struct uint3 { uint x, y, z; };
namespace metal {
inline float max(float a, float b) { return a > b ? a : b; }
inline float exp(float x) { return std::exp(x); }
}
struct Barrier {  // std::barrier is C++20 and missing from older libc++
  std::mutex mutex;
  std::condition_variable cv;
  int waiting = 0;
  long generation = 0;
  void wait() {
    std::unique_lock<std::mutex> lock(mutex);
    const long gen = generation;
    if (++waiting == 32) {
      waiting = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != gen; });
    }
  }
};
static float lane_values[32];
static Barrier simd_barrier;
thread_local uint current_lane;
float simd_sum(float x) {
  lane_values[current_lane] = x;
  simd_barrier.wait();
  float total = 0.0f;
  for (int i = 0; i < 32; ++i) total += lane_values[i];
  simd_barrier.wait();  // nobody overwrites lane_values before every lane has summed
  return total;
}
template <typename T, int HEADS, int KV_HEADS, int HEAD_DIM, int BLOCK_SIZE, int NUM_BLOCKS>
void body(const device T* q, const device T* k_cache, const device T* v_cache, const device int* tables,
          const constant int* tables_shape, const device int* lengths, const device float* scale, device T* out,
          uint3 threadgroup_position_in_grid, uint thread_index_in_simdgroup) {
  current_lane = thread_index_in_simdgroup;
@SOURCE@
}
static std::vector<float> read(const char* path, size_t n) {
  std::vector<float> v(n);
  FILE* f = std::fopen(path, "rb");
  if (std::fread(v.data(), sizeof(float), n, f) != n) std::abort();
  std::fclose(f);
  return v;
}
int main() {
  constexpr int D = @D@, H = @HEADS@, KVH = @KV_HEADS@, DIM = @HEAD_DIM@, BS = @BLOCK_SIZE@, NB = @NUM_BLOCKS@, MB = @MAX_BLOCKS@;
  auto q = read("q.bin", D * H * DIM);
  auto k = read("k.bin", size_t(KVH) * NB * BS * DIM);
  auto v = read("v.bin", size_t(KVH) * NB * BS * DIM);
  int tables[D * MB] = {@TABLES@};
  int lengths[D] = {@LENGTHS@};
  int tables_shape[2] = {D, MB};
  float scale[1] = {@SCALE@f};
  std::vector<float> out(D * H * DIM, -1.0f);
  for (uint seq = 0; seq < D; ++seq)
    for (uint head = 0; head < H; ++head) {
      std::vector<std::thread> lanes;
      for (uint lane = 0; lane < 32; ++lane)
        lanes.emplace_back([&, lane] {
          body<float, H, KVH, DIM, BS, NB>(q.data(), k.data(), v.data(), tables, tables_shape,
                                           lengths, scale, out.data(), uint3{0, head, seq}, lane);
        });
      for (auto& t : lanes) t.join();
    }
  FILE* f = std::fopen("out.bin", "wb");
  std::fwrite(out.data(), sizeof(float), out.size(), f);
  std::fclose(f);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++17) to compile the kernel body on the host")
def test_kernel_body_runs_on_the_host_against_the_reference(tmp_path: Path) -> None:
    """The very SOURCE string the Metal kernel is built from, executed lane by lane.

    This checks the indexing, GQA mapping, masking and online softmax of the body;
    Metal compilation and the real GPU run need a Mac (test below).
    """
    head_dim = 40  # not a multiple of 32: lanes 8..31 own one dimension, not two
    scale = head_dim**-0.5
    (q, k, v, tables, lengths), _ = make_inputs(head_dim, mx.float32, seed=3)
    for name, a in (("q", q), ("k", k), ("v", v)):
        np.array(a, dtype=np.float32).tofile(tmp_path / f"{name}.bin")
    values = {
        "SOURCE": MK.SOURCE, "D": len(LENGTHS), "HEADS": HEADS, "KV_HEADS": KV_HEADS, "HEAD_DIM": head_dim,
        "BLOCK_SIZE": BLOCK_SIZE, "NUM_BLOCKS": NUM_BLOCKS, "MAX_BLOCKS": len(TABLES[0]),
        "TABLES": ", ".join(str(b) for row in TABLES for b in row), "LENGTHS": ", ".join(map(str, LENGTHS)),
        "SCALE": repr(scale),
    }
    program = SHIM
    for key, value in values.items():
        program = program.replace(f"@{key}@", str(value))
    (tmp_path / "kernel.cpp").write_text(program)
    build = subprocess.run(["g++", "-std=c++17", "-O1", "-pthread", "-o", "kernel", "kernel.cpp"],
                           cwd=tmp_path, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    subprocess.run(["./kernel"], cwd=tmp_path, check=True, timeout=60)
    got = np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape(len(LENGTHS), HEADS, head_dim)
    want = MK.paged_decode_attention_reference(q, k, v, tables, lengths, scale)
    np.testing.assert_allclose(got, np.array(want), rtol=1e-5, atol=1e-5)


# -- the kernel on Metal ---------------------------------------------------------------


@pytest.mark.skipif(not METAL, reason=NEEDS_METAL)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_metal_kernel_matches_the_reference(dtype: mx.Dtype, head_dim: int) -> None:
    args, _ = make_inputs(head_dim, dtype, seed=4)
    scale = head_dim**-0.5
    got = MK.PagedDecodeAttention()(*args, scale)
    want = MK.paged_decode_attention_reference(*args, scale)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=tol, atol=tol)
