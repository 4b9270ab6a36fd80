// The one fold of 16 float32 lanes (lanes i and i + 8, then the halves of that, then (0 + 2) and (1 + 3), then
// their sum) that invariant_linear, invariant_rms_norm and exact_linear end with, on each instruction set: their
// results are the same bits only while they share it. No torch here: the exact kernels' torch-free core
// (exact_core.cpp) folds with it too, so it builds for ARM without ATen.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace ifx {

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The 16 lanes held in two 8-lane registers (lanes 0-7, 8-15): AVX2 kernels keep the AVX-512 ones' lanes, order
// and fold, so their float32 results are the same bits. AVX-512 builds have it too: an AVX-512 CPU runs the
// AVX2 kernels of exact_core.cpp (the K types').
inline float fold16(__m256 lo, __m256 hi) {
  const __m256 h = _mm256_add_ps(lo, hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
#endif
#if defined(__AVX512F__)
inline float fold16(__m512 v) { return fold16(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
// NEON: the 16 lanes in four 4-lane registers (lanes 0-3, 4-7, 8-11, 12-15). Not vaddvq_f32: its pairwise
// order, (0 + 1) + (2 + 3), is not the fold's (0 + 2) + (1 + 3).
inline float fold16(float32x4_t a0, float32x4_t a1, float32x4_t a2, float32x4_t a3) {
  const float32x4_t q = vaddq_f32(vaddq_f32(a0, a2), vaddq_f32(a1, a3));  // lanes i + (i + 8), then the halves
  const float32x2_t p = vadd_f32(vget_low_f32(q), vget_high_f32(q));     // (0 + 2), (1 + 3)
  return vget_lane_f32(p, 0) + vget_lane_f32(p, 1);
}
#endif

// Plain C++ (the portable builds): the same tree over an array, in place.
inline float fold16(float lane[16]) {
  for (int width = 8; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) lane[i] += lane[i + width];
  return lane[0];
}

}  // namespace ifx
