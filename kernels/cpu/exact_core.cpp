// exact_linear's float32 kernel, torch-free (exact_core.h): each output is invariant_linear's float32 reduction
// (16 lanes, lane l summing the products at k = l mod 16 front to back by fused multiply-adds, then fold16.h's
// one fold) over the weights the loader decodes the blocks to (exact_blocks.h). The lanes come from one header
// per instruction set: AVX2 + FMA + F16C (exact_lanes_avx2.h; AVX-512 builds run it for the K types), ARM64
// NEON (exact_lanes_neon.h), or plain C++ (exact_lanes_portable.h; IFX_EXACT_PORTABLE forces it). They share
// lanes, order and fold, so every one gives the same bits; this file is the one copy of the two ways through.
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
//   2 rows x 2 outputs (8 accumulator registers on AVX2, 4 of x, 2 of weights: one load per FMA, which is
//   what the load ports can feed; 3 x 2 spilled x and ran a third slower), so the decoding is paid once per
//   weight row and a pair of x rows is reused from L1 across the group. Only the group is ever dense:
//   memory stays at the blocks' size.
// Which way a row goes never changes its bits: both sum the same products in the same lanes and order.
// Threads are the caller's (exact_f32.cpp: at::parallel_for over ranges of outputs).
#pragma GCC optimize("fp-contract=off")  // the loader's product and sum round separately: no fused multiply-add
#include "exact_core.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(IFX_EXACT_PORTABLE)
#include "exact_lanes_avx2.h"
#elif defined(__ARM_NEON) && defined(__aarch64__) && !defined(IFX_EXACT_PORTABLE)
#include "exact_lanes_neon.h"
#else
#include "exact_lanes_portable.h"
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

namespace ifx::exact {
namespace {

constexpr int64_t kRegisterRows = 4;  // up to this many rows: blocks decoded in registers
// More rows: weight rows decoded at a time (an even number). 8 measured faster than 2 or a group sized to L1 at
// 32 rows (benchmarks/bench_exact_linear.py --dtype float32, 2-core AMD EPYC Zen 3).
constexpr int64_t kGroup = 8;

// A weight row (K weights) decoded into out [K].
template <int64_t QT>
inline void decode_row(const uint8_t* row, int64_t K, float* out) {
  V16 w[2];
  for (int64_t b = 0; b < K / block_values(QT); ++b, out += block_values(QT)) {
    const uint8_t* blk = row + b * block_bytes(QT);
    if constexpr (is_k_type(QT)) {
      KDecoder<QT> dec;
      dec.load(blk);
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) {
        dec(r, w);
        store16(out + r * QK, w[0]);
        store16(out + r * QK + 16, w[1]);
      }
    } else {
      decode<QT>(blk, w);
      store16(out, w[0]);
      store16(out + 16, w[1]);
    }
  }
}

// 32 weights into one row's sums: two 16-chunks, front to back.
inline void block_fma(const float* x, const V16 w[2], V16& acc) {
  acc = fma16(acc, load16(x), w[0]);
  acc = fma16(acc, load16(x + 16), w[1]);
}

// Rows [0, MR) against outputs [n, n + NR), blocks decoded in registers. NR outputs go together so that
// one row still has several independent FMA chains.
template <int64_t QT, int MR, int NR>
inline void register_tile(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n, float* y,
                          int64_t ldy) {
  V16 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = zero();
  V16 wv[2];
  if constexpr (is_k_type(QT)) {
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
  // 6-8 accumulator registers on AVX2. A K super-block's decoding needs more registers of its own: Q4_K one row
  // takes two outputs, Q6_K one (measured fastest at 1-4 rows, 4096 x 2048, one thread, AMD EPYC Zen 5).
  constexpr int NR = QT == Q6_K ? 1 : QT == Q4_K ? (MR == 1 ? 2 : 1) : MR == 1 ? 4 : MR == 2 ? 2 : 1;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) register_tile<QT, MR, NR>(x, K, w, row_bytes, n, y, ldy);
  for (; n < n1; ++n) register_tile<QT, MR, 1>(x, K, w, row_bytes, n, y, ldy);
}

// Rows [0, MR) of x against NR decoded weight rows (wd, [NR, K]), outputs n..n+NR.
template <int MR, int NR>
inline void buffer_tile(const float* x, int64_t K, const float* wd, int64_t n, float* y, int64_t ldy) {
  V16 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = zero();
  for (int64_t k = 0; k < K; k += 16)
    for (int j = 0; j < NR; ++j) {
      const V16 wk = load16(wd + j * K + k);
      for (int i = 0; i < MR; ++i) acc[i][j] = fma16(acc[i][j], load16(x + i * K + k), wk);
    }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + n + j] = fold(acc[i][j]);
}

// Rows of x against `pairs` pairs of decoded weight rows (wd, [2 * pairs, K]), outputs n.. : each tile of 2 rows
// passes over every pair while its rows are still in L1, so x streams from L2 once per group, not once per pair.
inline void buffer_rows(const float* x, int64_t M, int64_t K, const float* wd, int pairs, int64_t n, float* y,
                        int64_t ldy) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2)
    for (int j = 0; j < pairs; ++j) buffer_tile<2, 2>(x + m * K, K, wd + 2 * j * K, n + 2 * j, y + m * ldy, ldy);
  if (m < M)
    for (int j = 0; j < pairs; ++j) buffer_tile<1, 2>(x + m * K, K, wd + 2 * j * K, n + 2 * j, y + m * ldy, ldy);
}

// More than kRegisterRows rows, outputs [n0, n1): weight rows decoded kGroup at a time into a buffer.
template <int64_t QT>
void grouped_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                  float* y, int64_t ldy) {
  std::vector<float> wd(kGroup * K);
  int64_t n = n0;
  while (n1 - n >= 2) {
    const int pairs = static_cast<int>(std::min<int64_t>(kGroup, n1 - n) / 2);
    for (int r = 0; r < 2 * pairs; ++r) decode_row<QT>(w + (n + r) * row_bytes, K, wd.data() + r * K);
    buffer_rows(x, M, K, wd.data(), pairs, n, y, ldy);
    n += 2 * pairs;
  }
  if (n < n1) {  // an odd output left at the end of the range
    decode_row<QT>(w + n * row_bytes, K, wd.data());
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) buffer_tile<3, 1>(x + m * K, K, wd.data(), n, y + m * ldy, ldy);
    if (M - m == 2) buffer_tile<2, 1>(x + m * K, K, wd.data(), n, y + m * ldy, ldy);
    if (M - m == 1) buffer_tile<1, 1>(x + m * K, K, wd.data(), n, y + m * ldy, ldy);
  }
}

template <int64_t QT>
void rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
          float* y, int64_t ldy) {
  switch (M) {
    case 1: register_rows<QT, 1>(x, K, w, row_bytes, n0, n1, y, ldy); break;
    case 2: register_rows<QT, 2>(x, K, w, row_bytes, n0, n1, y, ldy); break;
    case 3: register_rows<QT, 3>(x, K, w, row_bytes, n0, n1, y, ldy); break;
    case 4: register_rows<QT, 4>(x, K, w, row_bytes, n0, n1, y, ldy); break;
    default: grouped_rows<QT>(x, M, K, w, row_bytes, n0, n1, y, ldy); break;
  }
}

template <int64_t QT>
void decoded_rows(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) decode_row<QT>(w + n * row_bytes, K, out + n * K);
}

}  // namespace
}  // namespace ifx::exact

namespace ifx {

const char* exact_core_isa() { return exact::kLanes; }

int64_t exact_rows_grain(int64_t M) { return M <= exact::kRegisterRows ? 16 : exact::kGroup; }

bool exact_rows_f32(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t qtype,
                    int64_t n0, int64_t n1, float* y, int64_t ldy) {
  using namespace exact;
  if (M <= 0 || n1 <= n0) return block_bytes(qtype) > 0;
  switch (qtype) {
    case Q4_0: rows<Q4_0>(x, M, K, w, row_bytes, n0, n1, y, ldy); return true;
    case Q4_1: rows<Q4_1>(x, M, K, w, row_bytes, n0, n1, y, ldy); return true;
    case Q8_0: rows<Q8_0>(x, M, K, w, row_bytes, n0, n1, y, ldy); return true;
    case Q4_K: rows<Q4_K>(x, M, K, w, row_bytes, n0, n1, y, ldy); return true;
    case Q6_K: rows<Q6_K>(x, M, K, w, row_bytes, n0, n1, y, ldy); return true;
    default: return false;
  }
}

bool decode_rows_f32(const uint8_t* w, int64_t qtype, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1,
                     float* out) {
  using namespace exact;
  switch (qtype) {
    case Q4_0: decoded_rows<Q4_0>(w, row_bytes, K, n0, n1, out); return true;
    case Q4_1: decoded_rows<Q4_1>(w, row_bytes, K, n0, n1, out); return true;
    case Q8_0: decoded_rows<Q8_0>(w, row_bytes, K, n0, n1, out); return true;
    case Q4_K: decoded_rows<Q4_K>(w, row_bytes, K, n0, n1, out); return true;
    case Q6_K: decoded_rows<Q6_K>(w, row_bytes, K, n0, n1, out); return true;
    default: return false;
  }
}

}  // namespace ifx
