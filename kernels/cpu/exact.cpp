// y = x @ W^T for bfloat16 activations, with W kept in ggml's blocks (Q4_0, Q4_1, Q8_0) but
// multiplied as the bfloat16 weights the loader makes of them: each block is decoded in
// registers to exactly those values (the loader's float32 arithmetic, then rounded to
// bfloat16), and reduced in invariant_linear's order (invariant.cpp: 32 products a chunk into
// 16 float32 lanes by vdpbf16ps, K front to back, one fixed fold). So the result is
// invariant_linear's on the dense bfloat16 weight, bit for bit, while a one-row step reads
// 0.6-1.1 bytes a weight instead of 2: decode is memory-bound, and this is what makes it fast.
//
// Why not qmatmul (qmatmul.cpp): it rounds the activations to int8 first, as llama.cpp does,
// so a row multiplied there and the same row in a batch GEMM on the dense weights differ by
// more than rounding. Here both sides multiply the same bfloat16 numbers in float32.
//
// Decoding a block: Q4_0 and Q4_1 have 16 possible values a block, so the 16 are computed once
// (float32, then rounded) and each weight is a 16-bit table lookup (vpermw) by its nibble.
// Q8_0's 32 int8 values are widened and scaled. The loader's formulas (backends/models/quants.py):
// Q4_0 (q - 8) * d, Q4_1 q * d + m (a product rounded, then a sum rounded), Q8_0 q * d.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define IFX_EXACT 1
#endif

namespace {

constexpr int64_t QK = 32;
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8;

constexpr int64_t block_bytes(int64_t qtype) { return qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : 0; }

#ifdef IFX_EXACT
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

// The 32 weights of one block as bfloat16, in the block's element order.
template <int64_t QT>
inline __m512i decode(const uint8_t* blk) {
  if constexpr (QT == Q8_0) {
    const __m512 d = _mm512_set1_ps(half_at(blk));
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2)))), d);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18)))), d);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // elements 0-15 from lo, 16-31 from hi
  } else {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table;
    if constexpr (QT == Q4_1)  // the product rounded, then the sum: not a fused multiply-add
      table = _mm512_add_ps(_mm512_mul_ps(q, _mm512_set1_ps(half_at(blk))), _mm512_set1_ps(half_at(blk + 2)));
    else
      table = _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(8.f)), _mm512_set1_ps(half_at(blk)));
    const __m512i values = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(table));
    // ggml's order: element j is the low nibble of byte j, element j + 16 its high nibble.
    const __m128i qs = _mm_loadu_si128((const __m128i*)(blk + (QT == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(qs, mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
    const __m512i idx = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
    return _mm512_permutexvar_epi16(idx, values);
  }
}

// Rows [0, MR) of x against outputs [n0, n1): each block decoded once for the MR rows.
template <int64_t QT, int MR>
void tile(const c10::BFloat16* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
          c10::BFloat16* y, int64_t ldy) {
  const int64_t nb = K / QK;
  constexpr int64_t kBytes = block_bytes(QT);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m512 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m512i wv = decode<QT>(row + b * kBytes);
      for (int i = 0; i < MR; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(x + i * K + b * QK), (__m512bh)wv);
    }
    for (int i = 0; i < MR; ++i) y[i * ldy + n] = c10::BFloat16(ifx::fold16(acc[i]));
  }
}

template <int64_t QT>
void run(const c10::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
         c10::BFloat16* y) {
  // Threads split the outputs only; every element's reduction is the same whatever the split or M.
  // Rows go in tiles of up to 8, each block decoded once a tile: a step reads the weights once per 8 rows.
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += 8) {
      const c10::BFloat16* xm = x + m * K;
      c10::BFloat16* ym = y + m * N;
      switch (std::min<int64_t>(M - m, 8)) {
        case 1: tile<QT, 1>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        case 2: tile<QT, 2>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        case 3: tile<QT, 3>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        case 4: tile<QT, 4>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        case 5: tile<QT, 5>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        case 6: tile<QT, 6>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        case 7: tile<QT, 7>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        default: tile<QT, 8>(xm, K, w, row_bytes, n0, n1, ym, N); break;
      }
    }
  });
}
#endif

}  // namespace

namespace ifx {

bool exact_linear_supported() {
#ifdef IFX_EXACT
  return true;
#else
  return false;
#endif
}

void exact_linear_rows(const c10::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
                       int64_t qtype, c10::BFloat16* y) {
#ifdef IFX_EXACT
  if (M <= 0 || N <= 0) return;
  switch (qtype) {
    case Q4_0: run<Q4_0>(x, M, K, w, N, row_bytes, y); break;
    case Q4_1: run<Q4_1>(x, M, K, w, N, row_bytes, y); break;
    default: run<Q8_0>(x, M, K, w, N, row_bytes, y); break;
  }
#else
  TORCH_CHECK(false, "exact_linear needs AVX-512 BF16, which this build's CPU lacks");
#endif
}

}  // namespace ifx

torch::Tensor exact_linear(torch::Tensor x, torch::Tensor w, int64_t qtype) {
  TORCH_CHECK(ifx::exact_linear_supported(), "exact_linear needs AVX-512 BF16, which this build's CPU lacks");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "exact_linear: x must be bfloat16 [M, K]");
  TORCH_CHECK(block_bytes(qtype) > 0, "exact_linear: unsupported ggml type ", qtype, " (Q4_0=2, Q4_1=3, Q8_0=8)");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % QK == 0, "exact_linear: K = ", K, " is not a multiple of ", QK);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() &&
                  w.size(1) == K / QK * block_bytes(qtype),
              "exact_linear: blocks must be contiguous uint8 [N, ", K / QK * block_bytes(qtype), "] for K = ", K,
              " of type ", qtype);
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  ifx::exact_linear_rows(xc.data_ptr<c10::BFloat16>(), M, K, w.data_ptr<uint8_t>(), N, w.size(1), qtype,
                         y.data_ptr<c10::BFloat16>());
  return y;
}
