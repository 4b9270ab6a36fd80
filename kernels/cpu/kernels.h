// Every C++ kernel of the CPU extension, declared once. Each kernel lives in its
// own .cpp file in this directory (kernels/cpu/__init__.py compiles all of them
// into one library); bindings.cpp, the only file with a PYBIND11_MODULE, exposes
// each with one m.def line. Adding a kernel: its .cpp, a declaration here, a line there.
//
// Only ATen's tensor and factory headers here, not <torch/extension.h>: that one (the whole C++
// API and pybind11) takes about a minute to compile per file on a 2-core CI machine, and only
// bindings.cpp needs it; with it in every file the first build took four and a half minutes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <memory>
#include <vector>

#include "exact_core.h"  // the block types and exact_linear's torch-free float32 core
#include "fold16.h"      // the one fold of 16 float32 lanes

// paged_attention.cpp: causal attention of a few query tokens per sequence over the paged KV cache.
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                              at::Tensor block_tables, at::Tensor context_lens, at::Tensor query_start,
                              double scale);

// qmatmul.cpp: y = x @ W^T (float32 [M, N]) with W as ggml blocks (uint8 [N, row_bytes]) of type qtype
// (ggml's ids: Q4_0 = 2, Q4_1 = 3, Q8_0 = 8); each row's result is independent of M and of its position.
at::Tensor qmatmul(at::Tensor x, at::Tensor w, int64_t qtype);
// qmatmul.cpp: ggml blocks (those three types, and Q4_K = 12, Q6_K = 14) to a dense [N, K] tensor, float32 or
// (bf16) bfloat16.
at::Tensor dequantize_blocks(at::Tensor w, int64_t qtype, int64_t K, bool bf16);

// exact.cpp: y = x @ W^T ([M, N], x's dtype) for bfloat16 or float32 x [M, K], W as ggml blocks (Q4_0, Q4_1, Q8_0;
// Q4_K and Q6_K with float32 rows) decoded to the loader's weights in that dtype: invariant_linear's bits on those
// weights, reading the blocks. bfloat16 needs AVX-512 BF16 (ifx::exact_linear_supported says whether it was
// built); float32 runs everywhere.
at::Tensor exact_linear(at::Tensor x, at::Tensor w, int64_t qtype);

// invariant.cpp: batch-invariant y = x @ w^T (+ bias), x [M, K], w [N, K], float32 or bfloat16 (the dtype of x);
// each element reduced over K in one fixed order, so a row's result never depends on M, its position or threads.
at::Tensor invariant_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
// invariant.cpp: RMSNorm over the last dimension, each row in float32 in the same fixed order.
at::Tensor invariant_rms_norm(at::Tensor x, at::Tensor weight, double eps);

// fused.cpp: the layer's elementwise ops in one pass each (kernels.cpu.fast, the default kernel set).
// residual + x (rounded to the dtype), then RMSNorm of it per row in float32 in a fixed order; no residual: x.
// Returns {normalised, new residual}.
std::vector<at::Tensor> fused_add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual,
                                              at::Tensor weight, double eps);
// fused.cpp: half-split RoPE of x [tokens, heads, head_dim] (rows may be strided) with cos/sin [tokens, 1, head_dim].
at::Tensor fused_rope(at::Tensor x, at::Tensor cos, at::Tensor sin);
// fused.cpp: SiLU(gate) * up of gate_up [rows, 2 * n] -> [rows, n].
at::Tensor fused_silu_and_mul(at::Tensor gate_up);

// decode_loop.cpp: every layer of a decode step in one call (the C++ loop over layers): it holds the packed
// weights and reused buffers; bindings.cpp makes it the module's Python class DecodeLoop.
class DecodeLoop {
 public:
  // part_weights, part_qtypes, part_of: the parts of stacked projections (blocks of several types, the blocks
  // mode), each with the index (layer * 4 + projection) of the projection it belongs to, in output order.
  DecodeLoop(std::vector<at::Tensor> layers, std::vector<int64_t> qtypes, int64_t num_heads, int64_t num_kv_heads,
             int64_t head_dim, double eps, double scale, std::vector<at::Tensor> exact_dense,
             std::vector<int64_t> exact_below, std::vector<at::Tensor> part_weights = {},
             std::vector<int64_t> part_qtypes = {}, std::vector<int64_t> part_of = {});
  ~DecodeLoop();
  int64_t num_layers() const;
  // x [M, hidden] (the embedded tokens) -> {hidden states, residual} after the last layer, before the final
  // norm. Both are this loop's buffers, overwritten by the next step of M rows: use them before that.
  std::vector<at::Tensor> step(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                               const std::vector<at::Tensor>& v_caches, const at::Tensor& slots, const at::Tensor& cos,
                               const at::Tensor& sin, const at::Tensor& tables, const at::Tensor& lens,
                               const at::Tensor& starts);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ----- The kernels' inner functions on raw buffers: what the tensor entry points above call after
// their checks, and what decode_loop.cpp calls directly, with no tensor or dispatch per op. Each is
// instantiated for float and c10::BFloat16 in its own .cpp file.
namespace ifx {

// exact.cpp: exact_linear on raw buffers (y [M, N] in x's dtype); exact_linear_supported(bf16) says whether the
// kernel for bfloat16 (or float32) rows was built.
bool exact_linear_supported(bool bf16);
void exact_linear_rows(const c10::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
                       int64_t qtype, c10::BFloat16* y);
void exact_linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
                       int64_t qtype, float* y);
// exact_f32.cpp: the float32 kernel of builds without AVX-512 (exact_core.cpp's AVX2, NEON or portable lanes),
// and of the K types in every build, over threads.
void exact_linear_rows_f32(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
                           int64_t qtype, float* y);
// exact_f32.cpp: N rows of blocks (any type above) to float32 [N, K]: the loader's values, as exact_linear
// multiplies them (dequantize_blocks' K types).
void decode_block_rows(const uint8_t* w, int64_t qtype, int64_t N, int64_t row_bytes, int64_t K, float* out);

// fused.cpp: rows x n; residual null: new_residual is x (copied there unless it is x itself).
template <typename T>
void add_rms_norm_rows(const T* x, const T* residual, const T* weight, int64_t rows, int64_t n, float eps, T* out,
                       T* new_residual);
// fused.cpp: x [tokens, heads, dim] with the given token and head strides -> out, contiguous.
template <typename T>
void rope_rows(const T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t row_stride, int64_t head_stride,
               const T* cos, const T* sin, T* out);

// paged_attention.cpp: the shapes of one call. q's element (s, j, head, d) is at
// s * q_seq_stride + j * q_tok_stride + head * head_dim + d; out is contiguous [num_seqs, q_len, heads, head_dim].
struct PagedShape {
  int64_t num_seqs, q_len, heads, head_dim, q_seq_stride, q_tok_stride;
  int64_t kv_heads, num_blocks, block_size, max_blocks;
};
template <typename T>
void paged_attention_rows(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables, const int64_t* lens,
                          const int64_t* starts, const PagedShape& shape, double scale, T* out);

// qmatmul.cpp: one row of x as int8 blocks: q[K], d[K/32] (scale), s[K/32] (sum of q, as float).
struct QRow {
  const int8_t* q;
  const float* d;
  const float* s;
};
// Per-call working memory of qmatmul_rows, kept by a caller that calls it often (resized, never shrunk).
struct QScratch {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<QRow> rows;
};
// y [M, N] (float32) = x [M, K] @ W^T, W as ggml blocks [N, row_bytes] of type qtype.
template <typename T>
void qmatmul_rows(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes, int64_t qtype,
                  float* y, QScratch& scratch);

}  // namespace ifx
