// exact_core.cpp's lanes in plain C++, for builds with neither AVX2 nor NEON (generic x86-64, other CPUs): the
// same 16 lanes, order and fold as the vector ones, each multiply-add an explicit std::fma (not left to the
// compiler's contraction choices), the blocks decoded by exact_blocks.h's scalar decoder.
#pragma once

#include "exact_blocks.h"
#include "fold16.h"

#include <cmath>
#include <cstring>

namespace ifx::exact {

constexpr const char* kLanes = "portable";

struct V16 {
  float lane[16];
};

inline V16 zero() { return V16{}; }
inline V16 load16(const float* p) {
  V16 v;
  std::memcpy(v.lane, p, sizeof(v.lane));
  return v;
}
inline void store16(float* p, const V16& v) { std::memcpy(p, v.lane, sizeof(v.lane)); }
inline V16 fma16(const V16& acc, const V16& x, const V16& w) {
  V16 r;
  for (int l = 0; l < 16; ++l) r.lane[l] = std::fma(x.lane[l], w.lane[l], acc.lane[l]);
  return r;
}
inline float fold(V16 v) { return fold16(v.lane); }

// One block's 32 weights: elements 0-15 in w[0], 16-31 in w[1].
template <int64_t QT>
inline void decode(const uint8_t* blk, V16 w[2]) {
  float v[QK];
  decode_scalar<QT>(blk, v);
  w[0] = load16(v);
  w[1] = load16(v + 16);
}

// A K super-block: load(blk) decodes all its 256 weights, (r, w) hands out run r.
template <int64_t QT>
struct KDecoder {
  float values[256];
  void load(const uint8_t* blk) { decode_scalar<QT>(blk, values); }
  void operator()(int r, V16 w[2]) const {
    w[0] = load16(values + QK * r);
    w[1] = load16(values + QK * r + 16);
  }
};

}  // namespace ifx::exact
