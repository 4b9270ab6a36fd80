// What every instruction set's exact kernel shares about the blocks (exact_core.cpp and its lanes headers):
// the K types' packed scales and bit layout, and a block decoded one value at a time in plain C++ (the
// portable lanes' decoder, and the reference the vector decoders follow). The loader's formulas
// (backends/models/quants.py), each product and sum rounded on its own (the including file turns off
// fp-contract): Q4_0 (q - 8) * d; Q4_1 q * d + m; Q8_0 q * d; Q4_K (d * sc) * q - dmin * m, the sub-block's
// scale d * sc and offset dmin * m each rounded first; Q6_K (q - 32) * (sc * d), the scale rounded first.
#pragma once

#include "exact_core.h"

#include <cstdint>
#include <cstring>

namespace ifx::exact {

constexpr int64_t QK = 32;  // values decoded at a time: a block, or one run of a K super-block
constexpr int64_t Q4_0 = kQ4_0, Q4_1 = kQ4_1, Q8_0 = kQ8_0, Q4_K = kQ4_K, Q6_K = kQ6_K;

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
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

// One block's weights (block_values(QT) of them) as float32, in element order: the loader's values, scalar.
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

}  // namespace ifx::exact
