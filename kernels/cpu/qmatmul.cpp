// y = x @ W^T with W kept in ggml's own blocks (Q4_0, Q4_1, Q8_0: 32 weights and
// a float16 scale, plus a float16 minimum for Q4_1), the way llama.cpp multiplies
// them: each row of x is quantised once to int8 blocks of 32 (a scale per block and
// the block's sum, like ggml's q8_1), and each output is a sum over blocks of an
// integer dot product times the two scales. Decode reads the weights once per step,
// so reading 4.5-8.5 bits a weight instead of bfloat16's 16 is what makes it fast.
//
// Batch invariance: the value of y[m, n] depends only on row m of x and row n of W.
// Every output runs the same instruction sequence over the blocks in index order
// (one 8-lane float accumulator, then one fixed horizontal sum), whatever M is,
// where the row sits in the batch, and which thread computes it; float steps are
// explicit fused multiply-adds, so the compiler's contraction choices cannot differ
// between call sites either.
#include "kernels.h"

#include <ATen/Parallel.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>  // the AVX2 and AVX-512 paths below; other CPUs (ARM) take the portable one
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t QK = 32;  // weights per block, for every type here
// ggml's type ids (ggml.h: GGML_TYPE_Q4_0 = 2, Q4_1 = 3, Q8_0 = 8).
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8;

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return 2 + QK / 2;
    case Q4_1: return 4 + QK / 2;
    case Q8_0: return 2 + QK;
    default: TORCH_CHECK(false, "qmatmul: unsupported ggml type ", qtype, " (Q4_0=2, Q4_1=3, Q8_0=8)");
  }
  return 0;
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

using ifx::QRow;  // one row of x as int8 blocks (kernels.h)

// Round half away from zero, as ggml's roundf does: the same on every path.
template <typename T>
void quantise_row(const T* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / QK; ++b) {
    float v[QK];
    float amax = 0.f;
    for (int64_t j = 0; j < QK; ++j) {
      v[j] = static_cast<float>(x[b * QK + j]);
      amax = std::fmax(amax, std::fabs(v[j]));
    }
    const float scale = amax / 127.f;
    const float inv = scale != 0.f ? 1.f / scale : 0.f;
    int sum = 0;
    for (int64_t j = 0; j < QK; ++j) {
      const int qi = static_cast<int>(std::round(v[j] * inv));
      q[b * QK + j] = static_cast<int8_t>(qi);
      sum += qi;
    }
    d[b] = scale;
    s[b] = static_cast<float>(sum);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// 32 bytes x (unsigned) times 32 bytes y (signed), summed in groups of four into 8 int32.
inline __m256i dot_u8s8(__m256i x, __m256i y) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), x, y);
#else
  const __m256i pairs = _mm256_maddubs_epi16(x, y);  // |15 or 128 x 127| x 2 fits int16
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);  // element j low nibble, j + 16 high
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// The dot product of one weight row with R rows of x: out[r] for rows[r].
template <int64_t QT, int R>
inline void dot_rows(const uint8_t* w, int64_t nb, const QRow* rows, float* out) {
  __m256 acc[R];
  float extra[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    extra[r] = 0.f;
  }
  constexpr int64_t bytes = QT == Q4_0 ? 18 : QT == Q4_1 ? 20 : 34;
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    const float dw = f16(w);
    __m256i wq;
    if constexpr (QT == Q8_0) {
      wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
    } else {
      wq = unpack_nibbles(w + (QT == Q4_1 ? 4 : 2));
    }
    // Q4_1's minimum and Q4_0's offset of -8 multiply the block's sum of x.
    const float off = QT == Q4_1 ? f16(w + 2) : QT == Q4_0 ? -8.f * dw : 0.f;
    const __m256i wabs = QT == Q8_0 ? _mm256_sign_epi8(wq, wq) : wq;
    for (int r = 0; r < R; ++r) {
      __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r].q + b * QK));
      if constexpr (QT == Q8_0) xq = _mm256_sign_epi8(xq, wq);  // signed x signed as |w| x (x sign(w))
      const __m256 sums = _mm256_cvtepi32_ps(dot_u8s8(wabs, xq));
      const float dx = rows[r].d[b];
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), sums, acc[r]);
      if constexpr (QT != Q8_0) extra[r] = std::fma(off * dx, rows[r].s[b], extra[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + extra[r];
}
#else
// Portable path: integer sums per block, float accumulation in block order.
template <int64_t QT, int R>
inline void dot_rows(const uint8_t* w, int64_t nb, const QRow* rows, float* out) {
  constexpr int64_t bytes = QT == Q4_0 ? 18 : QT == Q4_1 ? 20 : 34;
  for (int r = 0; r < R; ++r) {
    float acc = 0.f, extra = 0.f;
    const uint8_t* wb = w;
    for (int64_t b = 0; b < nb; ++b, wb += bytes) {
      const float dw = f16(wb);
      const int8_t* xq = rows[r].q + b * QK;
      int sum = 0;
      if constexpr (QT == Q8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(wb + 2);
        for (int j = 0; j < QK; ++j) sum += q[j] * xq[j];
      } else {
        const uint8_t* qs = wb + (QT == Q4_1 ? 4 : 2);
        for (int j = 0; j < QK / 2; ++j) sum += (qs[j] & 0x0F) * xq[j] + (qs[j] >> 4) * xq[j + QK / 2];
      }
      const float dx = rows[r].d[b];
      acc = std::fma(dw * dx, static_cast<float>(sum), acc);
      const float off = QT == Q4_1 ? f16(wb + 2) : QT == Q4_0 ? -8.f * dw : 0.f;
      if constexpr (QT != Q8_0) extra = std::fma(off * dx, rows[r].s[b], extra);
    }
    out[r] = acc + extra;
  }
}
#endif

// Rows of x in groups of four per weight row (each weight block read once per
// group), the rest one at a time: the per-row arithmetic is the same either way.
template <int64_t QT>
void run(const uint8_t* w, int64_t N, int64_t row_bytes, int64_t nb, const std::vector<QRow>& rows, float* y) {
  const int64_t M = static_cast<int64_t>(rows.size());
  // Column tiles: a tile's weights stay in cache while every row goes over them.
  const int64_t tile = 16;
  at::parallel_for(0, (N + tile - 1) / tile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n1 = std::min(N, (t + 1) * tile);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        for (int64_t n = t * tile; n < n1; ++n) {
          float out[4];
          dot_rows<QT, 4>(w + n * row_bytes, nb, &rows[m], out);
          for (int r = 0; r < 4; ++r) y[(m + r) * N + n] = out[r];
        }
      }
      for (; m < M; ++m) {
        for (int64_t n = t * tile; n < n1; ++n) dot_rows<QT, 1>(w + n * row_bytes, nb, &rows[m], &y[m * N + n]);
      }
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight floats to bfloat16 the way c10::BFloat16 rounds (to nearest, ties to even), in 32-bit lanes.
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  return _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
}

// One block to 32 bfloat16s with the scalar path's arithmetic (q * d, then + m where it has one).
inline void block_to_bf16(const uint8_t* blk, int64_t qtype, c10::BFloat16* o) {
  const __m256 d = _mm256_set1_ps(f16(blk));
  const __m256 mn = _mm256_set1_ps(qtype == Q4_1 ? f16(blk + 2) : 0.f);
  __m256i q;
  if (qtype == Q8_0) {
    q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    q = unpack_nibbles(blk + (qtype == Q4_1 ? 4 : 2));
    if (qtype == Q4_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
  }
  __m256i bits[4];
  for (int i = 0; i < 4; ++i) {
    const __m128i part = i < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
    const __m128i eight = (i & 1) ? _mm_srli_si128(part, 8) : part;
    const __m256 v = _mm256_cvtepi32_ps(qtype == Q4_1 ? _mm256_cvtepu8_epi32(eight) : _mm256_cvtepi8_epi32(eight));
    const __m256 x = _mm256_mul_ps(v, d);
    bits[i] = bf16_bits(qtype == Q8_0 ? x : _mm256_add_ps(x, mn));
  }
  for (int i = 0; i < 4; i += 2) {  // packus interleaves 128-bit lanes: put them back in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits[i], bits[i + 1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i * 8), packed);
  }
}
#endif

template <typename T>
void dequantise(const uint8_t* w, int64_t qtype, int64_t N, int64_t row_bytes, int64_t K, T* out) {
  const int64_t nb = K / QK, bytes = block_bytes(qtype);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* blk = w + n * row_bytes;
      T* o = out + n * K;
      for (int64_t b = 0; b < nb; ++b, blk += bytes, o += QK) {
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          block_to_bf16(blk, qtype, o);
          continue;
        }
#endif
        const float d = f16(blk);
        if (qtype == Q8_0) {
          const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
          for (int j = 0; j < QK; ++j) o[j] = static_cast<T>(d * q[j]);
        } else {
          const uint8_t* qs = blk + (qtype == Q4_1 ? 4 : 2);
          const float mn = qtype == Q4_1 ? f16(blk + 2) : 0.f;
          const int bias = qtype == Q4_0 ? 8 : 0;
          for (int j = 0; j < QK / 2; ++j) {
            // ggml's own formula (x = q * d + m), so dequantised weights match gguf's bit for bit.
            o[j] = static_cast<T>(((qs[j] & 0x0F) - bias) * d + mn);
            o[j + QK / 2] = static_cast<T>(((qs[j] >> 4) - bias) * d + mn);
          }
        }
      }
    }
  });
}

// k_types: whether the caller reads Q4_K and Q6_K too (dequantize_blocks does, through exact_core.cpp's decoder).
void check_blocks(const at::Tensor& w, int64_t qtype, int64_t K, bool k_types = false) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "qmatmul: weights must be a contiguous uint8 [N, row_bytes] tensor of blocks");
  const int64_t values = k_types && ifx::is_k_type(qtype) ? ifx::block_values(qtype) : QK;
  const int64_t bytes = k_types && ifx::is_k_type(qtype) ? ifx::block_bytes(qtype) : block_bytes(qtype);
  TORCH_CHECK(K > 0 && K % values == 0, "qmatmul: K must be a positive multiple of ", values, ", got ", K);
  TORCH_CHECK(w.size(1) == K / values * bytes, "qmatmul: ", w.size(1), " bytes a row do not hold K = ", K,
              " weights of type ", qtype);
}

}  // namespace

namespace ifx {

template <typename T>
void qmatmul_rows(const T* x, int64_t M, int64_t K, const uint8_t* wp, int64_t N, int64_t row_bytes, int64_t qtype,
                  float* y, QScratch& scratch) {
  const int64_t nb = K / QK;
  scratch.q.resize(M * K);
  scratch.d.resize(M * nb);
  scratch.s.resize(M * nb);
  int8_t* q = scratch.q.data();
  float* d = scratch.d.data();
  float* s = scratch.s.data();
  // Rows are quantised independently (each by itself, in block order).
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantise_row(x + m * K, K, &q[m * K], &d[m * nb], &s[m * nb]);
  });
  scratch.rows.resize(M);
  for (int64_t m = 0; m < M; ++m) scratch.rows[m] = QRow{&q[m * K], &d[m * nb], &s[m * nb]};
  if (M > 0 && N > 0) {
    switch (qtype) {
      case Q4_0: run<Q4_0>(wp, N, row_bytes, nb, scratch.rows, y); break;
      case Q4_1: run<Q4_1>(wp, N, row_bytes, nb, scratch.rows, y); break;
      default: run<Q8_0>(wp, N, row_bytes, nb, scratch.rows, y); break;
    }
  }
}

template void qmatmul_rows<float>(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*,
                                  QScratch&);
template void qmatmul_rows<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, const uint8_t*, int64_t, int64_t,
                                          int64_t, float*, QScratch&);

}  // namespace ifx

at::Tensor qmatmul(at::Tensor x, at::Tensor w, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2, "qmatmul: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "qmatmul: x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_blocks(w, qtype, K);
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  ifx::QScratch scratch;
  if (x.scalar_type() == at::kFloat)
    ifx::qmatmul_rows(xc.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), N, w.size(1), qtype, y.data_ptr<float>(),
                      scratch);
  else
    ifx::qmatmul_rows(xc.data_ptr<c10::BFloat16>(), M, K, w.data_ptr<uint8_t>(), N, w.size(1), qtype,
                      y.data_ptr<float>(), scratch);
  return y;
}

at::Tensor dequantize_blocks(at::Tensor w, int64_t qtype, int64_t K, bool bf16) {
  check_blocks(w, qtype, K, /*k_types=*/true);
  const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;
  const int64_t N = w.size(0);
  if (ifx::is_k_type(qtype)) {  // exact_linear's decoder: the loader's float32 values (then rounded to bfloat16)
    auto values = at::empty({N, K}, w.options().dtype(at::kFloat));
    ifx::decode_block_rows(w.data_ptr<uint8_t>(), qtype, N, w.size(1), K, values.data_ptr<float>());
    return bf16 ? values.to(at::kBFloat16) : values;
  }
  auto out = at::empty({N, K}, w.options().dtype(dtype));
  if (dtype == at::kFloat) {
    dequantise(w.data_ptr<uint8_t>(), qtype, N, w.size(1), K, out.data_ptr<float>());
  } else {
    dequantise(w.data_ptr<uint8_t>(), qtype, N, w.size(1), K, out.data_ptr<c10::BFloat16>());
  }
  return out;
}
