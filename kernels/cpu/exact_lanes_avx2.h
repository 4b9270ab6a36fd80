// exact_core.cpp's lanes on AVX2 + FMA + F16C (every x86-64 CPU since Haswell and Zen 1; AVX-512 builds use
// them too): invariant_linear's 16 float32 lanes in two 8-lane registers, and the blocks decoded in registers.
// The lanes, their order and the fold are invariant_linear's, so the bits are too.
#pragma once

#include "exact_blocks.h"
#include "fold16.h"

#include <immintrin.h>

namespace ifx::exact {

constexpr const char* kLanes = "avx2";

struct V16 {  // lanes 0-7 and 8-15
  __m256 lo, hi;
};

inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store16(float* p, const V16& v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline V16 fma16(const V16& acc, const V16& x, const V16& w) {
  return {_mm256_fmadd_ps(x.lo, w.lo, acc.lo), _mm256_fmadd_ps(x.hi, w.hi, acc.hi)};
}
inline float fold(const V16& v) { return fold16(v.lo, v.hi); }

inline __m256i widen8(const uint8_t* p) {  // 8 bytes to 8 int32 (vpmovzxbd from memory)
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// One block's 32 weights: elements 0-15 in w[0], 16-31 in w[1].
template <int64_t QT>
inline void decode(const uint8_t* blk, V16 w[2]) {
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk)));
  __m256 v[4];
  if constexpr (QT == Q8_0) {
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i)))),
          d);
  } else {
    const uint8_t* qs = blk + (QT == Q4_1 ? 4 : 2);
    const __m256i b0 = widen8(qs), b1 = widen8(qs + 8);  // bytes 0-7, 8-15
    const __m256i mask = _mm256_set1_epi32(0x0F);
    __m256i q[4] = {_mm256_and_si256(b0, mask), _mm256_and_si256(b1, mask), _mm256_srli_epi32(b0, 4),
                    _mm256_srli_epi32(b1, 4)};
    if constexpr (QT == Q4_1) {
      const __m256 m = _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2)));
      for (int i = 0; i < 4; ++i) v[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q[i]), d), m);
    } else {
      const __m256i eight = _mm256_set1_epi32(8);
      for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], eight)), d);
    }
  }
  w[0] = {v[0], v[1]};
  w[1] = {v[2], v[3]};
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
  void operator()(int r, V16 w[2]) const {
    const uint8_t* q = qs + 32 * (r / 2);  // runs 2j and 2j + 1: the low and high nibbles of 32 bytes
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256 a = _mm256_broadcast_ss(scale + r), b = _mm256_broadcast_ss(offset + r);
    __m256 v[4];
    for (int i = 0; i < 4; ++i) {
      const __m256i n = _mm256_and_si256(_mm256_srli_epi32(widen8(q + 8 * i), 4 * (r % 2)), mask);
      v[i] = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(n), a), b);
    }
    w[0] = {v[0], v[1]};
    w[1] = {v[2], v[3]};
  }
};

template <>
struct KDecoder<Q6_K> {
  alignas(32) float scale[16];  // per 16 values: sc * d, rounded (the loader's)
  const uint8_t* blk;
  void load(const uint8_t* p) {
    blk = p;
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(p + kQ6D)));
    for (int h = 0; h < 2; ++h) {
      const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kQ6Scales + 8 * h)));
      _mm256_store_ps(scale + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(sc), d));
    }
  }
  void operator()(int r, V16 w[2]) const {
    const uint8_t *ql = q6_low(blk, r), *qh = q6_high(blk, r);
    __m256 v[4];
    for (int i = 0; i < 4; ++i) {
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(widen8(ql + 8 * i), q6_low_shift(r)), _mm256_set1_epi32(0x0F));
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(widen8(qh + 8 * i), q6_high_shift(r)), _mm256_set1_epi32(3));
      const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
      v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_broadcast_ss(scale + 2 * r + i / 2));
    }
    w[0] = {v[0], v[1]};
    w[1] = {v[2], v[3]};
  }
};

}  // namespace ifx::exact
