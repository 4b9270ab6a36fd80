// exact_linear's float32 kernel for CPUs without AVX-512: AVX2 + FMA + F16C (every x86-64 CPU since
// Haswell and Zen 1, Intel's client CPUs since Alder Lake), and a portable one in plain C++ for the rest
// (ARM, where the compiler vectorises it, and generic x86-64 builds). exact.cpp holds the contract and the
// AVX-512 kernels; this file keeps the same one: each output is invariant_linear's float32 reduction (16
// lanes, lane l summing the products at k = l mod 16 front to back by fused multiply-adds, then the one
// fold of kernels.h) over the weights the loader decodes the blocks to (backends/models/quants.py: Q4_0
// (q - 8) * d, Q4_1 q * d + m with the product and the sum each rounded, Q8_0 q * d; Q4_K (d * sc) * q -
// dmin * m, with the sub-block's scale d * sc and offset dmin * m each rounded first, then the product, then
// the difference; Q6_K (q - 32) * (sc * d), the scale rounded first). AVX2 holds the 16 lanes in two 8-lane
// registers; the lanes, their order and the fold are the same, so the bits are too.
//
// The K types (Q4_K, Q6_K: super-blocks of 256 values) go through the same two ways as runs of 32 values:
// a super-block's scales are decoded once per weight row it belongs to, then each of its 8 runs of 32 like a
// Q4_0 block. They have no AVX-512 kernel of their own: AVX-512 builds multiply them here too (exact.cpp).
//
// Two ways through, by the number of rows:
// * up to kRegisterRows (4) rows (decode, memory-bound): each block is decoded in registers straight from
//   the weights and multiplied into every row's sums, so a step reads the blocks once, 0.6-1.1 bytes a
//   weight against float32's 4;
// * more rows (prefill, large batches, compute-bound): each weight row is decoded once into a small
//   float32 buffer (eight weight rows at a time), and every pair of rows of x passes over it in tiles of
//   2 rows x 2 outputs (8 accumulator registers, 4 of x, 2 of weights: one load per FMA, which is what
//   the load ports can feed; 3 x 2 spilled x and ran a third slower), so the decoding is paid once per
//   weight row and a pair of x rows is reused from L1 across the group. Only the group is ever dense:
//   memory stays at the blocks' size.
// Which way a row goes never changes its bits: both sum the same products in the same lanes and order.
#pragma GCC optimize("fp-contract=off")  // the loader's product and sum round separately: no fused multiply-add
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define IFX_EXACT_AVX2 1
#endif

namespace {

constexpr int64_t QK = 32;  // values a register path decodes at a time: a block, or one run of a K super-block
using ifx::block_bytes;
using ifx::block_values;
constexpr int64_t Q4_0 = ifx::kQ4_0, Q4_1 = ifx::kQ4_1, Q8_0 = ifx::kQ8_0, Q4_K = ifx::kQ4_K, Q6_K = ifx::kQ6_K;
constexpr int64_t kRegisterRows = 4;  // up to this many rows: blocks decoded in registers
// More rows: weight rows decoded at a time (an even number). 8 measured faster than 2 or a group sized to L1 at
// 32 rows (benchmarks/bench_exact_linear.py --dtype float32, 2-core AMD EPYC Zen 3).
constexpr int64_t kGroup = 8;

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Q4_K's eight 6-bit scales and eight 6-bit minimums, packed in 12 bytes (ggml's get_scale_min_k4): runs 0-3
// take the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); runs 4-7 their low 4 bits from bytes 8-11 and
// their top 2 from the spare top bits of bytes 0-3 / 4-7.
inline void k4_scales(const uint8_t* s, int32_t sc[8], int32_t mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// Q6_K: run r (32 values) of a super-block lies in half h = r / 4 as group g = r % 4, which takes its low 4 bits
// from the low (g < 2) or high nibbles of ql[64 h + 32 (g % 2) ...] and its top 2 from bits 2g of qh[32 h ...].
constexpr int64_t kQ6Scales = 192, kQ6D = 208;  // the 16 int8 scales (one per 16 values) and the float16 d
inline const uint8_t* q6_low(const uint8_t* blk, int r) { return blk + 64 * (r / 4) + 32 * (r % 2); }
inline const uint8_t* q6_high(const uint8_t* blk, int r) { return blk + 128 + 32 * (r / 4); }
inline int q6_low_shift(int r) { return (r % 4) < 2 ? 0 : 4; }
inline int q6_high_shift(int r) { return 2 * (r % 4); }

// One block's weights (block_values(QT) of them) as float32, in element order: the loader's values, scalar
// (the portable kernel's decoder).
template <int64_t QT>
inline void decode_scalar(const uint8_t* blk, float* out) {
  const float d = half_at(QT == Q6_K ? blk + kQ6D : blk);
  if constexpr (QT == Q4_K) {
    const float dmin = half_at(blk + 2);
    int32_t sc[8], mn[8];
    k4_scales(blk + 4, sc, mn);
    for (int r = 0; r < 8; ++r) {
      const float scale = d * static_cast<float>(sc[r]), offset = dmin * static_cast<float>(mn[r]);
      const uint8_t* qs = blk + 16 + 32 * (r / 2);  // runs 2j and 2j + 1: the low and high nibbles of 32 bytes
      for (int l = 0; l < QK; ++l) out[QK * r + l] = static_cast<float>((qs[l] >> (4 * (r % 2))) & 0x0F) * scale - offset;
    }
  } else if constexpr (QT == Q6_K) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + kQ6Scales);
    for (int r = 0; r < 8; ++r) {
      const uint8_t *ql = q6_low(blk, r), *qh = q6_high(blk, r);
      for (int l = 0; l < QK; ++l) {
        const int q = (((ql[l] >> q6_low_shift(r)) & 0x0F) | (((qh[l] >> q6_high_shift(r)) & 3) << 4)) - 32;
        out[QK * r + l] = static_cast<float>(q) * (static_cast<float>(scales[2 * r + l / 16]) * d);
      }
    }
  } else if constexpr (QT == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < QK; ++j) out[j] = static_cast<float>(q[j]) * d;
  } else {
    const uint8_t* qs = blk + (QT == Q4_1 ? 4 : 2);
    const float m = QT == Q4_1 ? half_at(blk + 2) : 0.f;
    for (int j = 0; j < QK / 2; ++j) {
      // ggml's order: element j is the low nibble of byte j, element j + 16 its high nibble.
      const int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
      if constexpr (QT == Q4_1) {
        out[j] = static_cast<float>(lo) * d + m;
        out[j + QK / 2] = static_cast<float>(hi) * d + m;
      } else {
        out[j] = static_cast<float>(lo - 8) * d;
        out[j + QK / 2] = static_cast<float>(hi - 8) * d;
      }
    }
  }
}

// A weight row (K weights) decoded into out [K].
template <int64_t QT>
inline void decode_row(const uint8_t* row, int64_t K, float* out);

#ifdef IFX_EXACT_AVX2

// 16 lanes: lanes 0-7 and 8-15.
struct Acc {
  __m256 lo, hi;
};

inline Acc zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }

inline float fold(const Acc& a) { return ifx::fold16(a.lo, a.hi); }

// One block's 32 weights in four registers (elements 0-7, 8-15, 16-23, 24-31).
template <int64_t QT>
inline void decode(const uint8_t* blk, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk)));
  if constexpr (QT == Q8_0) {
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i)))),
          d);
  } else {
    const uint8_t* qs = blk + (QT == Q4_1 ? 4 : 2);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));      // bytes 0-7
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));  // bytes 8-15
    const __m256i mask = _mm256_set1_epi32(0x0F);
    __m256i q[4] = {_mm256_and_si256(b0, mask), _mm256_and_si256(b1, mask), _mm256_srli_epi32(b0, 4),
                    _mm256_srli_epi32(b1, 4)};
    if constexpr (QT == Q4_1) {
      const __m256 m = _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2)));
      for (int i = 0; i < 4; ++i) w[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q[i]), d), m);
    } else {
      const __m256i eight = _mm256_set1_epi32(8);
      for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], eight)), d);
    }
  }
}

inline __m256i widen8(const uint8_t* p) {  // 8 bytes to 8 int32 (vpmovzxbd from memory)
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// A K super-block's 8 runs of 32 weights in registers: load(blk) decodes its scales once, then (r, w) puts run r
// in w. Called with a constant r (the callers' loops are unrolled), so the nibble and bit shifts are immediates.
template <int64_t QT>
struct KDecoder;

template <>
struct KDecoder<Q4_K> {
  alignas(32) float scale[8], offset[8];  // per run: d * sc and dmin * m, each rounded (the loader's)
  const uint8_t* qs;
  void load(const uint8_t* blk) {
    qs = blk + 16;
    alignas(32) int32_t sc[8], mn[8];
    k4_scales(blk + 4, sc, mn);
    int32_t dm;  // d and dmin, float16
    std::memcpy(&dm, blk, 4);
    const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
    const __m256 d = _mm256_broadcastss_ps(both), dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(both));
    _mm256_store_ps(scale, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<__m256i*>(sc)))));
    _mm256_store_ps(offset, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<__m256i*>(mn)))));
  }
  void operator()(int r, __m256 w[4]) const {
    const uint8_t* q = qs + 32 * (r / 2);  // runs 2j and 2j + 1: the low and high nibbles of 32 bytes
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256 a = _mm256_broadcast_ss(scale + r), b = _mm256_broadcast_ss(offset + r);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = _mm256_and_si256(_mm256_srli_epi32(widen8(q + 8 * i), 4 * (r % 2)), mask);
      w[i] = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), a), b);
    }
  }
};

template <>
struct KDecoder<Q6_K> {
  alignas(32) float scale[16];  // per 16 values: sc * d, rounded (the loader's)
  const uint8_t* blk;
  void load(const uint8_t* p) {
    blk = p;
    const __m256 d = _mm256_set1_ps(half_at(p + kQ6D));
    for (int h = 0; h < 2; ++h) {
      const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kQ6Scales + 8 * h)));
      _mm256_store_ps(scale + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(sc), d));
    }
  }
  void operator()(int r, __m256 w[4]) const {
    const uint8_t *ql = q6_low(blk, r), *qh = q6_high(blk, r);
    for (int i = 0; i < 4; ++i) {
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(widen8(ql + 8 * i), q6_low_shift(r)), _mm256_set1_epi32(0x0F));
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(widen8(qh + 8 * i), q6_high_shift(r)), _mm256_set1_epi32(3));
      const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_broadcast_ss(scale + 2 * r + i / 2));
    }
  }
};

template <int64_t QT>
inline void decode_row(const uint8_t* row, int64_t K, float* out) {
  __m256 w[4];
  for (int64_t b = 0; b < K / block_values(QT); ++b, out += block_values(QT)) {
    const uint8_t* blk = row + b * block_bytes(QT);
    if constexpr (ifx::is_k_type(QT)) {
      KDecoder<QT> dec;
      dec.load(blk);
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) {
        dec(r, w);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + r * QK + 8 * i, w[i]);
      }
    } else {
      decode<QT>(blk, w);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, w[i]);
    }
  }
}

// 32 weights (four registers) into one row's sums: two 16-chunks, front to back.
inline void block_fma(const float* x, const __m256 w[4], Acc& a) {
  a.lo = _mm256_fmadd_ps(_mm256_loadu_ps(x), w[0], a.lo);
  a.hi = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w[1], a.hi);
  a.lo = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), w[2], a.lo);
  a.hi = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), w[3], a.hi);
}

// Rows [0, MR) against outputs [n, n + NR), blocks decoded in registers. NR outputs go together so that
// one row still has several independent FMA chains.
template <int64_t QT, int MR, int NR>
inline void register_tile(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n, float* y,
                          int64_t ldy) {
  Acc acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = zero();
  __m256 wv[4];
  if constexpr (ifx::is_k_type(QT)) {
    // A super-block at a time: each output's scales once, then run by run across the NR outputs. Both loops are
    // unrolled, so the sums stay in registers (a loop over j would keep them in memory) and the shifts constant.
    constexpr int64_t kValues = block_values(QT);
    KDecoder<QT> dec[NR];
    for (int64_t b = 0; b < K / kValues; ++b) {
      for (int j = 0; j < NR; ++j) dec[j].load(w + (n + j) * row_bytes + b * block_bytes(QT));
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
          dec[j](r, wv);
          for (int i = 0; i < MR; ++i) block_fma(x + i * K + b * kValues + r * QK, wv, acc[i][j]);
        }
    }
  } else {
    for (int64_t b = 0; b < K / QK; ++b)
      for (int j = 0; j < NR; ++j) {
        decode<QT>(w + (n + j) * row_bytes + b * block_bytes(QT), wv);
        for (int i = 0; i < MR; ++i) block_fma(x + i * K + b * QK, wv, acc[i][j]);
      }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + n + j] = fold(acc[i][j]);
}

template <int64_t QT, int MR>
void register_rows(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y,
                   int64_t ldy) {
  // 6-8 accumulator registers. A K super-block's decoding needs more registers of its own: Q4_K one row takes
  // two outputs, Q6_K one (measured fastest at 1-4 rows, 4096 x 2048, one thread, AMD EPYC Zen 5).
  constexpr int NR = QT == Q6_K ? 1 : QT == Q4_K ? (MR == 1 ? 2 : 1) : MR == 1 ? 4 : MR == 2 ? 2 : 1;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) register_tile<QT, MR, NR>(x, K, w, row_bytes, n, y, ldy);
  for (; n < n1; ++n) register_tile<QT, MR, 1>(x, K, w, row_bytes, n, y, ldy);
}

// Rows [0, MR) of x against NR decoded weight rows (wd, [NR, K]), outputs n..n+NR.
template <int MR, int NR>
inline void buffer_tile(const float* x, int64_t K, const float* wd, int64_t n, float* y, int64_t ldy) {
  Acc acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = zero();
  for (int64_t k = 0; k < K; k += 16)
    for (int j = 0; j < NR; ++j) {
      const __m256 wlo = _mm256_loadu_ps(wd + j * K + k), whi = _mm256_loadu_ps(wd + j * K + k + 8);
      for (int i = 0; i < MR; ++i) {
        acc[i][j].lo = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k), wlo, acc[i][j].lo);
        acc[i][j].hi = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k + 8), whi, acc[i][j].hi);
      }
    }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + n + j] = fold(acc[i][j]);
}

// Rows of x against `pairs` pairs of decoded weight rows (wd, [2 * pairs, K]), outputs n.. : each tile of 3 rows
// passes over every pair while its rows are still in L1, so x streams from L2 once per group, not once per pair.
inline void buffer_rows(const float* x, int64_t M, int64_t K, const float* wd, int pairs, int64_t n, float* y,
                        int64_t ldy) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2)
    for (int j = 0; j < pairs; ++j) buffer_tile<2, 2>(x + m * K, K, wd + 2 * j * K, n + 2 * j, y + m * ldy, ldy);
  if (m < M)
    for (int j = 0; j < pairs; ++j) buffer_tile<1, 2>(x + m * K, K, wd + 2 * j * K, n + 2 * j, y + m * ldy, ldy);
}

template <int64_t QT>
void run(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes, float* y) {
  // Threads split the outputs only: every element's reduction is the same whatever the split or M.
  if (M <= kRegisterRows) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      switch (M) {
        case 1: register_rows<QT, 1>(x, K, w, row_bytes, n0, n1, y, N); break;
        case 2: register_rows<QT, 2>(x, K, w, row_bytes, n0, n1, y, N); break;
        case 3: register_rows<QT, 3>(x, K, w, row_bytes, n0, n1, y, N); break;
        default: register_rows<QT, 4>(x, K, w, row_bytes, n0, n1, y, N); break;
      }
    });
    return;
  }
  at::parallel_for(0, N, kGroup, [&](int64_t n0, int64_t n1) {
    std::vector<float> wd(kGroup * K);
    int64_t n = n0;
    while (n1 - n >= 2) {
      const int pairs = static_cast<int>(std::min<int64_t>(kGroup, n1 - n) / 2);
      for (int r = 0; r < 2 * pairs; ++r) decode_row<QT>(w + (n + r) * row_bytes, K, wd.data() + r * K);
      buffer_rows(x, M, K, wd.data(), pairs, n, y, N);
      n += 2 * pairs;
    }
    if (n < n1) {  // an odd output left at the end of the range
      decode_row<QT>(w + n * row_bytes, K, wd.data());
      int64_t m = 0;
      for (; m + 3 <= M; m += 3) buffer_tile<3, 1>(x + m * K, K, wd.data(), n, y + m * N, N);
      if (M - m == 2) buffer_tile<2, 1>(x + m * K, K, wd.data(), n, y + m * N, N);
      if (M - m == 1) buffer_tile<1, 1>(x + m * K, K, wd.data(), n, y + m * N, N);
    }
  });
}

#else  // portable: the same lanes and fold in plain C++, every multiply-add an explicit std::fma

template <int64_t QT>
inline void decode_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / block_values(QT); ++b)
    decode_scalar<QT>(row + b * block_bytes(QT), out + b * block_values(QT));
}

inline float fold(float lane[16]) {
  for (int width = 8; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) lane[i] += lane[i + width];
  return lane[0];
}

template <int64_t QT>
void run(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes, float* y) {
  at::parallel_for(0, N, 4, [&](int64_t n0, int64_t n1) {
    std::vector<float> wd(K);
    for (int64_t n = n0; n < n1; ++n) {
      decode_row<QT>(w + n * row_bytes, K, wd.data());
      for (int64_t m = 0; m < M; ++m) {
        float lane[16] = {};
        for (int64_t k = 0; k < K; k += 16)
          for (int l = 0; l < 16; ++l) lane[l] = std::fma(x[m * K + k + l], wd[k + l], lane[l]);
        y[m * N + n] = fold(lane);
      }
    }
  });
}

#endif

template <int64_t QT>
void decode_rows(const uint8_t* w, int64_t N, int64_t row_bytes, int64_t K, float* out) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) decode_row<QT>(w + n * row_bytes, K, out + n * K);
  });
}

}  // namespace

namespace ifx {

void exact_linear_rows_avx2(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
                            int64_t qtype, float* y) {
  if (M <= 0 || N <= 0) return;
  switch (qtype) {
    case Q4_0: run<Q4_0>(x, M, K, w, N, row_bytes, y); break;
    case Q4_1: run<Q4_1>(x, M, K, w, N, row_bytes, y); break;
    case Q8_0: run<Q8_0>(x, M, K, w, N, row_bytes, y); break;
    case Q4_K: run<Q4_K>(x, M, K, w, N, row_bytes, y); break;
    case Q6_K: run<Q6_K>(x, M, K, w, N, row_bytes, y); break;
    default: TORCH_CHECK(false, "exact_linear: unsupported ggml type ", qtype);
  }
}

void decode_block_rows(const uint8_t* w, int64_t qtype, int64_t N, int64_t row_bytes, int64_t K, float* out) {
  switch (qtype) {
    case Q4_0: decode_rows<Q4_0>(w, N, row_bytes, K, out); break;
    case Q4_1: decode_rows<Q4_1>(w, N, row_bytes, K, out); break;
    case Q8_0: decode_rows<Q8_0>(w, N, row_bytes, K, out); break;
    case Q4_K: decode_rows<Q4_K>(w, N, row_bytes, K, out); break;
    case Q6_K: decode_rows<Q6_K>(w, N, row_bytes, K, out); break;
    default: TORCH_CHECK(false, "decode_block_rows: unsupported ggml type ", qtype);
  }
}

}  // namespace ifx
