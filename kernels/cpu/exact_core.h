// The float32 exact kernel's core, with no torch in it: the ggml block types, decoding them to the loader's
// weights, and the row kernels of exact_linear's float32 contract (exact_core.cpp). The ATen entry points
// (exact_f32.cpp) check tensors and split the outputs over threads; the core takes a range of outputs. Being
// torch-free, it builds for ARM with a cross compiler, and a standalone driver (driver/exact_driver.cpp) runs
// it under qemu-user, where no aarch64 torch exists (tests/kernels/test_kernels_arm_cross.py).
#pragma once

#include <cstdint>
#include <cstring>

namespace ifx {

// The ggml block types the kernels read (ggml.h's ids): values per block and bytes per block. Q4_0, Q4_1 and
// Q8_0 hold 32 values a block; the K types 256 a super-block (8 sub-blocks of 32 with 6-bit scales for Q4_K,
// 16 runs of 16 with int8 scales for Q6_K). qmatmul reads the 32-value types only; exact_linear (float32 rows)
// and dequantize_blocks all five.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;
constexpr bool is_k_type(int64_t qtype) { return qtype == kQ4_K || qtype == kQ6_K; }
constexpr int64_t block_values(int64_t qtype) { return is_k_type(qtype) ? 256 : 32; }
// 0: a type the kernels do not read.
constexpr int64_t block_bytes(int64_t qtype) {
  return qtype == kQ4_0 ? 18 : qtype == kQ4_1 ? 20 : qtype == kQ8_0 ? 34 : qtype == kQ4_K ? 144 : qtype == kQ6_K ? 210 : 0;
}

// float16 bits as float32, exactly, in plain C++: every finite half (subnormals too) and the infinities; a NaN
// keeps its sign and payload and comes back quiet, as F16C's and ARM's conversions give it.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13) | (mantissa ? 0x00400000u : 0u);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // rebias: 127 - 15
  } else {  // zero or subnormal: mantissa * 2^-24, both factors exact in float32, so the product is too
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The lanes exact_core.cpp was compiled with: "avx2", "neon" or "portable" (plain C++; IFX_EXACT_PORTABLE
// forces it).
const char* exact_core_isa();

// Outputs [n0, n1) of y = x @ W^T: x float32 [M, K], W blocks of qtype [N, row_bytes], y [M, ldy] (column n of
// row m at y[m * ldy + n]). Each output is invariant_linear's float32 reduction over the loader's weights, the
// same bits for any M, range or split. False (nothing written) for a type it does not read.
bool exact_rows_f32(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t qtype,
                    int64_t n0, int64_t n1, float* y, int64_t ldy);
// The number of outputs worth giving a thread at a time for M rows (the path's unit of work).
int64_t exact_rows_grain(int64_t M);
// Weight rows [n0, n1) of blocks (any type above) decoded to the loader's float32 values: row n to out + n * K.
// False (nothing written) for a type it does not read.
bool decode_rows_f32(const uint8_t* w, int64_t qtype, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1,
                     float* out);

}  // namespace ifx
