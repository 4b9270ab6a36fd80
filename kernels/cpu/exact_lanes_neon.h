// exact_core.cpp's lanes on ARM64 NEON (every aarch64 CPU): invariant_linear's 16 float32 lanes in four 4-lane
// registers (lanes 0-3, 4-7, 8-11, 12-15), each summed front to back by vfmaq_f32 (a fused multiply-add, as
// x86's), folded by fold16.h's tree; the blocks decoded in registers to the loader's values (float16 by the
// hardware's exact conversion, integers widened exactly, each product and sum rounded on its own: the
// including file turns off fp-contract, or the compiler would fuse vmulq_f32 and vaddq_f32 into one).
#pragma once

#include "exact_blocks.h"
#include "fold16.h"

#include <arm_neon.h>

namespace ifx::exact {

constexpr const char* kLanes = "neon";

struct V16 {
  float32x4_t q[4];
};

inline V16 zero() {
  const float32x4_t z = vdupq_n_f32(0.f);
  return {{z, z, z, z}};
}
inline V16 load16(const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
inline void store16(float* p, const V16& v) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, v.q[i]);
}
inline V16 fma16(const V16& acc, const V16& x, const V16& w) {
  V16 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vfmaq_f32(acc.q[i], x.q[i], w.q[i]);
  return r;
}
inline float fold(const V16& v) { return fold16(v.q[0], v.q[1], v.q[2], v.q[3]); }

inline float half(const uint8_t* p) {
  __fp16 h;  // fcvt: exact, subnormals included
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// 16 int8 values as float32 (exact), times s: one rounding each.
inline V16 scaled(int8x16_t q, float32x4_t s) {
  const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_high_s8(q);
  return {{vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), s), vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(lo)), s),
           vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), s), vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(hi)), s)}};
}
// v + b and v - b lane by lane, a rounding each: the loader's sum or difference after its product.
inline V16 plus(const V16& v, float32x4_t b) {
  V16 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vaddq_f32(v.q[i], b);
  return r;
}
inline V16 minus(const V16& v, float32x4_t b) {
  V16 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vsubq_f32(v.q[i], b);
  return r;
}
inline int8x16_t s8(uint8x16_t v) { return vreinterpretq_s8_u8(v); }

// One block's 32 weights: elements 0-15 in w[0], 16-31 in w[1].
template <int64_t QT>
inline void decode(const uint8_t* blk, V16 w[2]) {
  const float32x4_t d = vdupq_n_f32(half(blk));
  if constexpr (QT == Q8_0) {
    w[0] = scaled(vld1q_s8(reinterpret_cast<const int8_t*>(blk + 2)), d);
    w[1] = scaled(vld1q_s8(reinterpret_cast<const int8_t*>(blk + 18)), d);
  } else {
    // ggml's order: element j is the low nibble of byte j, element j + 16 its high nibble.
    const uint8x16_t qs = vld1q_u8(blk + (QT == Q4_1 ? 4 : 2));
    const uint8x16_t lo = vandq_u8(qs, vdupq_n_u8(0x0F)), hi = vshrq_n_u8(qs, 4);
    if constexpr (QT == Q4_1) {
      const float32x4_t m = vdupq_n_f32(half(blk + 2));
      w[0] = plus(scaled(s8(lo), d), m);
      w[1] = plus(scaled(s8(hi), d), m);
    } else {
      const int8x16_t eight = vdupq_n_s8(8);
      w[0] = scaled(vsubq_s8(s8(lo), eight), d);
      w[1] = scaled(vsubq_s8(s8(hi), eight), d);
    }
  }
}

// A K super-block's 8 runs of 32 weights in registers: load(blk) decodes its scales once, then (r, w) puts run r
// in w. The shifts go by register (vshlq_u8 by a negative count), so r need not be a compile-time constant.
template <int64_t QT>
struct KDecoder;

template <>
struct KDecoder<Q4_K> {
  float scale[8], offset[8];  // per run: d * sc and dmin * m, each rounded (the loader's)
  const uint8_t* qs;
  void load(const uint8_t* blk) {
    qs = blk + 16;
    int32_t sc[8], mn[8];
    k4_scales(blk + 4, sc, mn);
    const float d = half(blk), dmin = half(blk + 2);
    for (int r = 0; r < 8; ++r) {
      scale[r] = d * static_cast<float>(sc[r]);
      offset[r] = dmin * static_cast<float>(mn[r]);
    }
  }
  void operator()(int r, V16 w[2]) const {
    const uint8_t* q = qs + 32 * (r / 2);  // runs 2j and 2j + 1: the low and high nibbles of 32 bytes
    const int8x16_t shift = vdupq_n_s8(static_cast<int8_t>(-4 * (r % 2)));
    const float32x4_t a = vdupq_n_f32(scale[r]), b = vdupq_n_f32(offset[r]);
    for (int c = 0; c < 2; ++c) {
      const uint8x16_t n = vandq_u8(vshlq_u8(vld1q_u8(q + 16 * c), shift), vdupq_n_u8(0x0F));
      w[c] = minus(scaled(s8(n), a), b);
    }
  }
};

template <>
struct KDecoder<Q6_K> {
  float scale[16];  // per 16 values: sc * d, rounded (the loader's)
  const uint8_t* blk;
  void load(const uint8_t* p) {
    blk = p;
    const float d = half(p + kQ6D);
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + kQ6Scales);
    for (int i = 0; i < 16; ++i) scale[i] = static_cast<float>(sc[i]) * d;
  }
  void operator()(int r, V16 w[2]) const {
    const uint8_t *ql = q6_low(blk, r), *qh = q6_high(blk, r);
    const int8x16_t low_shift = vdupq_n_s8(static_cast<int8_t>(-q6_low_shift(r)));
    const int8x16_t high_shift = vdupq_n_s8(static_cast<int8_t>(-q6_high_shift(r)));
    for (int c = 0; c < 2; ++c) {
      const uint8x16_t lo = vandq_u8(vshlq_u8(vld1q_u8(ql + 16 * c), low_shift), vdupq_n_u8(0x0F));
      const uint8x16_t hi = vandq_u8(vshlq_u8(vld1q_u8(qh + 16 * c), high_shift), vdupq_n_u8(3));
      const int8x16_t q = vsubq_s8(s8(vorrq_u8(lo, vshlq_n_u8(hi, 4))), vdupq_n_s8(32));
      w[c] = scaled(q, vdupq_n_f32(scale[2 * r + c]));
    }
  }
};

}  // namespace ifx::exact
