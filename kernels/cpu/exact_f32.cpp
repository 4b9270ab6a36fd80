// exact_linear's float32 kernel as the extension calls it: the torch-free core (exact_core.cpp: AVX2, NEON or
// portable lanes, by the build's instruction set) run over threads. The core takes a range of outputs; here
// at::parallel_for splits the outputs only, so every element's reduction is the same whatever the split or M.
#include "kernels.h"

#include <ATen/Parallel.h>

namespace ifx {

void exact_linear_rows_f32(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
                           int64_t qtype, float* y) {
  TORCH_CHECK(block_bytes(qtype) > 0, "exact_linear: unsupported ggml type ", qtype);
  if (M <= 0 || N <= 0) return;
  at::parallel_for(0, N, exact_rows_grain(M), [&](int64_t n0, int64_t n1) {
    exact_rows_f32(x, M, K, w, row_bytes, qtype, n0, n1, y, N);
  });
}

void decode_block_rows(const uint8_t* w, int64_t qtype, int64_t N, int64_t row_bytes, int64_t K, float* out) {
  TORCH_CHECK(block_bytes(qtype) > 0, "decode_block_rows: unsupported ggml type ", qtype);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { decode_rows_f32(w, qtype, row_bytes, K, n0, n1, out); });
}

}  // namespace ifx
