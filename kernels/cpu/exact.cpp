// y = x @ W^T for bfloat16 or float32 activations, with W kept in ggml's blocks (Q4_0, Q4_1,
// Q8_0) but multiplied as the weights the loader makes of them in that dtype: each block is
// decoded in registers to exactly those values (the loader's float32 arithmetic, then, for
// bfloat16, rounded), and reduced in invariant_linear's order (invariant.cpp: 16 float32 lanes,
// K front to back in chunks of 32 bfloat16 products by vdpbf16ps or 16 float32 ones by FMA, one
// fixed fold). So the result is invariant_linear's on the dense weight, bit for bit, while a
// one-row step reads 0.6-1.1 bytes a weight instead of 2 (bfloat16) or 4 (float32): decode is
// memory-bound, and this is what makes it fast.
//
// Why not qmatmul (qmatmul.cpp): it rounds the activations to int8 first, as llama.cpp does,
// so a row multiplied there and the same row in a batch GEMM on the dense weights differ by
// more than rounding. Here both sides multiply the same numbers in float32.
//
// Decoding a block: Q4_0 and Q4_1 have 16 possible values a block, so the 16 are computed once
// (float32, and for bfloat16 rounded) and each weight is a table lookup by its nibble (vpermw on
// 16-bit values, vpermps on float32 ones). Q8_0's 32 int8 values are widened and scaled. The
// loader's formulas (backends/models/quants.py): Q4_0 (q - 8) * d, Q4_1 q * d + m (a product
// rounded, then a sum rounded), Q8_0 q * d.
//
// The bfloat16 kernel needs AVX-512 BF16; the float32 one here AVX-512F (and F16C, which every
// AVX-512 CPU has). Builds without AVX-512 take exact_core.cpp's float32 kernel (AVX2, ARM64 NEON, or portable
// C++, through exact_f32.cpp), which keeps the same contract: float32 rows are exact on every CPU. The K types
// (Q4_K, Q6_K) have no kernel here: their float32 rows go to exact_core.cpp's AVX2 kernel in AVX-512 builds too
// (every AVX-512 CPU runs AVX2, and the contract makes the bits the same), and bfloat16 rows of them are refused.
#pragma GCC optimize("fp-contract=off")  // the loader's product and sum round separately: no fused multiply-add
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define IFX_EXACT32 1
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define IFX_EXACT 1
#endif
#endif

namespace {

constexpr int64_t QK = 32;
constexpr int64_t Q4_0 = ifx::kQ4_0, Q4_1 = ifx::kQ4_1, Q8_0 = ifx::kQ8_0;
using ifx::block_bytes;

#ifdef IFX_EXACT32
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

// *p in every lane, loaded as such (vbroadcastss from memory: no shuffle).
inline __m512 broadcast(const float* p) {
  __m512 v;
  asm("vbroadcastss %1, %0" : "=v"(v) : "m"(*p));
  return v;
}

// A Q4 block's 16 possible weights in float32, by nibble: the loader's formula.
template <int64_t QT>
inline __m512 q4_table(const uint8_t* blk) {
  const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // d (and Q4_1's m) converted together from memory, then broadcast from memory: a conversion from a
  // register, or a broadcast from one, would take the shuffle port the lookups need (the compiler turns
  // a broadcast of a value it holds into one from a register, hence the asm).
  alignas(16) float dm[4];
  _mm_store_ps(dm, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)blk)));  // Q4_0: d, then its first quants
  const __m512 d = broadcast(dm);
  if constexpr (QT == Q4_1)  // the product rounded, then the sum: not a fused multiply-add
    return _mm512_add_ps(_mm512_mul_ps(q, d), broadcast(dm + 1));
  else
    return _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(8.f)), d);  // q - 8 is exact: a constant
}

// The float32 Q4 kernel works in a lane order of its own: lane j of a 16-chunk holds element kLane[j] (the
// 4 x 4 transpose; its own inverse), because a block's 16 bytes broadcast to every 128-bit quarter and
// shifted by 8 * (j / 4) bits put byte kLane[j] at the bottom of lane j with no shuffle, and the lookup
// reads only an index's low 4 bits. The activations are put in that order once a call, and each sum back
// in invariant_linear's before its fold: a lane still sums the same products in the same order.
alignas(64) constexpr int32_t kLane[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
alignas(64) constexpr int32_t kShift[16] = {0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24};

// The 32 weights of one block as float32 (elements 0-15 in lo, 16-31 in hi): Q8_0 in element order,
// Q4_0 and Q4_1 in kLane's.
template <int64_t QT>
inline void decode32(const uint8_t* blk, __m512& lo, __m512& hi) {
  if constexpr (QT == Q8_0) {
    const __m512 d = _mm512_set1_ps(half_at(blk));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2)))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18)))), d);
  } else {
    const __m512 table = q4_table<QT>(blk);
    // ggml's order: element j is the low nibble of byte j, element j + 16 its high nibble.
    const __m512i qs = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(blk + (QT == Q4_1 ? 4 : 2))));
    const __m512i shift = _mm512_load_si512(kShift);
    lo = _mm512_permutexvar_ps(_mm512_srlv_epi32(qs, shift), table);
    hi = _mm512_permutexvar_ps(_mm512_srlv_epi32(qs, _mm512_add_epi32(shift, _mm512_set1_epi32(4))), table);
  }
}

// float32 rows [0, MR) of x against outputs [n, n + NR): invariant_linear's float32 chunks (16 products by
// FMA, K front to back), each block decoded once for the MR rows. For Q4 types x is in kLane's order, and
// each sum is put back in element order before the fold. Each lane's sum is one chain of FMAs, so NR
// outputs go together: with one row, one chain would wait on the FMA's latency at every block.
template <int64_t QT, int MR, int NR>
inline void outputs32(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n, float* y,
                      int64_t ldy) {
  const int64_t nb = K / QK;
  constexpr int64_t kBytes = block_bytes(QT);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < NR; ++j) {
      __m512 lo, hi;
      decode32<QT>(w + (n + j) * row_bytes + b * kBytes, lo, hi);
      for (int i = 0; i < MR; ++i) {
        acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * K + b * QK), lo, acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * K + b * QK + 16), hi, acc[i][j]);
      }
    }
  }
  const __m512i back = _mm512_load_si512(kLane);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      y[i * ldy + n + j] = ifx::fold16(QT == Q8_0 ? acc[i][j] : _mm512_permutexvar_ps(back, acc[i][j]));
}

template <int64_t QT, int MR>
void tile32(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y,
            int64_t ldy) {
  constexpr int NR = MR == 1 ? 4 : MR == 2 ? 2 : 1;  // at least four chains where the rows allow
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) outputs32<QT, MR, NR>(x, K, w, row_bytes, n, y, ldy);
  for (; n < n1; ++n) outputs32<QT, MR, 1>(x, K, w, row_bytes, n, y, ldy);
}

// x [M, K] with each 16-chunk in kLane's order (the float32 Q4 kernel's).
inline void to_lanes(const float* x, int64_t M, int64_t K, float* out) {
  const __m512i order = _mm512_load_si512(kLane);
  for (int64_t k = 0; k < M * K; k += 16) _mm512_storeu_ps(out + k, _mm512_permutexvar_ps(order, _mm512_loadu_ps(x + k)));
}
#endif

#ifdef IFX_EXACT

// The 32 weights of one block as bfloat16, in the block's element order.
template <int64_t QT>
inline __m512i decode(const uint8_t* blk) {
  if constexpr (QT == Q8_0) {
    const __m512 d = _mm512_set1_ps(half_at(blk));
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2)))), d);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18)))), d);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // elements 0-15 from lo, 16-31 from hi
  } else {
    const __m512i values = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(q4_table<QT>(blk)));
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

#endif

#ifdef IFX_EXACT32
// One tile of MR rows in the activation dtype T: tile (bfloat16) or tile32 (float32).
template <typename T, int64_t QT, int MR>
inline void tile_of(const T* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, T* y,
                    int64_t ldy) {
  if constexpr (std::is_same_v<T, float>) {
    tile32<QT, MR>(x, K, w, row_bytes, n0, n1, y, ldy);
  } else {
#ifdef IFX_EXACT
    tile<QT, MR>(x, K, w, row_bytes, n0, n1, y, ldy);
#endif
  }
}

template <typename T, int64_t QT>
void run(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes, T* y) {
  std::vector<float> lanes;
  if constexpr (std::is_same_v<T, float> && QT != Q8_0) {  // the float32 Q4 kernel's lane order
    lanes.resize(M * K);
    to_lanes(x, M, K, lanes.data());
    x = lanes.data();
  }
  // Threads split the outputs only; every element's reduction is the same whatever the split or M.
  // Rows go in tiles of up to 8, each block decoded once a tile: a step reads the weights once per 8 rows.
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += 8) {
      const T* xm = x + m * K;
      T* ym = y + m * N;
      switch (std::min<int64_t>(M - m, 8)) {
        case 1: tile_of<T, QT, 1>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        case 2: tile_of<T, QT, 2>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        case 3: tile_of<T, QT, 3>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        case 4: tile_of<T, QT, 4>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        case 5: tile_of<T, QT, 5>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        case 6: tile_of<T, QT, 6>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        case 7: tile_of<T, QT, 7>(xm, K, w, row_bytes, n0, n1, ym, N); break;
        default: tile_of<T, QT, 8>(xm, K, w, row_bytes, n0, n1, ym, N); break;
      }
    }
  });
}

template <typename T>
void run_type(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes, int64_t qtype, T* y) {
  if (M <= 0 || N <= 0) return;
  switch (qtype) {
    case Q4_0: run<T, Q4_0>(x, M, K, w, N, row_bytes, y); break;
    case Q4_1: run<T, Q4_1>(x, M, K, w, N, row_bytes, y); break;
    default: run<T, Q8_0>(x, M, K, w, N, row_bytes, y); break;
  }
}
#endif

}  // namespace

namespace ifx {

bool exact_linear_supported(bool bf16) {
#ifdef IFX_EXACT
  return true;
#else
  return !bf16;  // float32: AVX-512F here, exact_core.cpp's kernel elsewhere
#endif
}

void exact_linear_rows(const c10::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
                       int64_t qtype, c10::BFloat16* y) {
  TORCH_CHECK(!is_k_type(qtype), "exact_linear multiplies Q4_K and Q6_K blocks by float32 rows only");
#ifdef IFX_EXACT
  run_type(x, M, K, w, N, row_bytes, qtype, y);
#else
  TORCH_CHECK(false, "exact_linear on bfloat16 rows needs AVX-512 BF16, which this build's CPU lacks");
#endif
}

void exact_linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
                       int64_t qtype, float* y) {
#ifdef IFX_EXACT32
  if (is_k_type(qtype))
    exact_linear_rows_f32(x, M, K, w, N, row_bytes, qtype, y);
  else
    run_type(x, M, K, w, N, row_bytes, qtype, y);
#else
  exact_linear_rows_f32(x, M, K, w, N, row_bytes, qtype, y);
#endif
}

}  // namespace ifx

at::Tensor exact_linear(at::Tensor x, at::Tensor w, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "exact_linear: x must be bfloat16 or float32 [M, K]");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(ifx::exact_linear_supported(bf16), "exact_linear on ", bf16 ? "bfloat16" : "float32",
              " rows needs AVX-512 BF16, which this build's CPU lacks");
  TORCH_CHECK(block_bytes(qtype) > 0, "exact_linear: unsupported ggml type ", qtype,
              " (Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q6_K=14)");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), values = ifx::block_values(qtype);
  TORCH_CHECK(K % values == 0, "exact_linear: K = ", K, " is not a multiple of ", values);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.size(1) == K / values * block_bytes(qtype),
              "exact_linear: blocks must be contiguous uint8 [N, ", K / values * block_bytes(qtype), "] for K = ", K,
              " of type ", qtype);
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  if (bf16)
    ifx::exact_linear_rows(xc.data_ptr<c10::BFloat16>(), M, K, w.data_ptr<uint8_t>(), N, w.size(1), qtype,
                           y.data_ptr<c10::BFloat16>());
  else
    ifx::exact_linear_rows(xc.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), N, w.size(1), qtype, y.data_ptr<float>());
  return y;
}
