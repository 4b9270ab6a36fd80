// Batch-invariant kernels: the result for one row never depends on how many
// other rows share the call, where the row sits among them, or how the work is
// split between threads. A library GEMM (oneDNN, MKL) picks its reduction split
// over K from the shape, so a request's logits moved by an ulp when other
// tenants' requests joined its batch, and in bfloat16 an ulp can flip a greedy
// token. Here every output element is owned by one thread and reduced over K in
// one fixed order: 16-lane float32 partial sums, K walked front to back in
// chunks (masked at the tail), the lanes folded by one fixed tree. Tiles over
// rows and columns only decide which elements are computed together, never how
// an element is computed, so tile shape, M and thread count cannot change a bit.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// -- one fixed reduction: 16 float lanes folded as a tree (halves, then halves again) --

#if defined(__AVX512F__)
using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline float fold(Acc v) { return ifx::fold16(v); }

// One chunk of K into an accumulator; the last chunk is masked, zeros adding nothing.
struct F32Chunk {
  static constexpr int64_t width = 16;
  using T = float;
  static inline Acc full(Acc acc, const float* a, const float* b) {
    return _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b), acc);
  }
  static inline Acc step(Acc acc, const float* a, const float* b, int64_t n) {
    if (n >= width) return _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b), acc);
    const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
    return _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a), _mm512_maskz_loadu_ps(m, b), acc);
  }
};

struct BF16Chunk {
  using T = c10::BFloat16;
#if defined(__AVX512BF16__)
  // vdpbf16ps: 32 bfloat16 products a chunk, summed in pairs into 16 float lanes.
  static constexpr int64_t width = 32;
  static inline Acc full(Acc acc, const T* a, const T* b) {
    const __m512i va = _mm512_loadu_si512(a), vb = _mm512_loadu_si512(b);
    return _mm512_dpbf16_ps(acc, (__m512bh)va, (__m512bh)vb);
  }
  static inline Acc step(Acc acc, const T* a, const T* b, int64_t n) {
    __m512i va, vb;
    if (n >= width) {
      va = _mm512_loadu_si512(a);
      vb = _mm512_loadu_si512(b);
    } else {
      const __mmask32 m = static_cast<__mmask32>((1ull << n) - 1);
      va = _mm512_maskz_loadu_epi16(m, a);
      vb = _mm512_maskz_loadu_epi16(m, b);
    }
    return _mm512_dpbf16_ps(acc, (__m512bh)va, (__m512bh)vb);
  }
#else
  // Widen 16 bfloat16 (the top halves of float32) and multiply-add in float32.
  static constexpr int64_t width = 16;
  static inline __m512 widen(const T* p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline Acc step(Acc acc, const T* a, const T* b, int64_t n) {
    const __mmask16 m = n >= width ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    return _mm512_fmadd_ps(widen(a, m), widen(b, m), acc);
  }
  static inline Acc full(Acc acc, const T* a, const T* b) { return step(acc, a, b, width); }
#endif
};
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: the same 16 lanes in two 8-lane registers, each chunk one FMA per lane, the same fold: the AVX-512
// kernels' float32 bits (and those of exact_core.cpp, which reduces blocks this way).
struct Acc {
  __m256 lo, hi;
};
inline Acc acc_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline float fold(Acc v) { return ifx::fold16(v.lo, v.hi); }

// A chunk of 16 elements as two 8-lane float32 registers; a tail of n < 16 padded with zeros.
inline void load16(const float* p, int64_t n, __m256& lo, __m256& hi) {
  if (n >= 16) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
    return;
  }
  alignas(32) float t[16] = {};
  std::memcpy(t, p, n * sizeof(float));
  lo = _mm256_load_ps(t);
  hi = _mm256_load_ps(t + 8);
}
inline __m256 widen8(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32: exact
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void load16(const c10::BFloat16* p, int64_t n, __m256& lo, __m256& hi) {
  if (n >= 16) {
    lo = widen8(p);
    hi = widen8(p + 8);
    return;
  }
  alignas(32) c10::BFloat16 t[16];
  std::memset(t, 0, sizeof(t));
  std::memcpy(t, p, n * sizeof(c10::BFloat16));
  lo = widen8(t);
  hi = widen8(t + 8);
}
template <typename E>
struct Avx2Chunk {
  static constexpr int64_t width = 16;
  using T = E;
  static inline Acc step(Acc acc, const T* a, const T* b, int64_t n) {
    __m256 alo, ahi, blo, bhi;
    load16(a, n, alo, ahi);
    load16(b, n, blo, bhi);
    return {_mm256_fmadd_ps(alo, blo, acc.lo), _mm256_fmadd_ps(ahi, bhi, acc.hi)};
  }
  static inline Acc full(Acc acc, const T* a, const T* b) { return step(acc, a, b, width); }
};
using F32Chunk = Avx2Chunk<float>;
using BF16Chunk = Avx2Chunk<c10::BFloat16>;
#else
// Portable: the same shape of reduction in plain C++ (16 lanes, fixed fold), each multiply-add an explicit
// fused one as the vector paths' are (not left to the compiler's contraction choices).
struct Acc {
  float lane[16];
};
inline Acc acc_zero() { return Acc{}; }
inline float fold(Acc v) {
  for (int width = 8; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) v.lane[i] += v.lane[i + width];
  return v.lane[0];
}
inline float widen1(float x) { return x; }
inline float widen1(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename E>
struct PortableChunk {
  static constexpr int64_t width = 16;
  using T = E;
  static inline Acc step(Acc acc, const T* a, const T* b, int64_t n) {
    const int64_t k = n < width ? n : width;
    for (int64_t i = 0; i < k; ++i) acc.lane[i] = std::fma(widen1(a[i]), widen1(b[i]), acc.lane[i]);
    return acc;
  }
  static inline Acc full(Acc acc, const T* a, const T* b) { return step(acc, a, b, width); }
};
using F32Chunk = PortableChunk<float>;
using BF16Chunk = PortableChunk<c10::BFloat16>;
#endif

inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) { return static_cast<float>(x); }

// An MR x NR tile of out = x w^T (+ bias): MR*NR accumulators walk K together,
// each in the same chunk order whatever MR and NR are.
template <typename C, int MR, int NR>
inline void tile(const typename C::T* x, const typename C::T* w, const typename C::T* bias, typename C::T* out,
                 int64_t K, int64_t ldo) {
  using T = typename C::T;
  Acc acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = acc_zero();
  // Whole chunks, then the masked tail: the same steps for every element.
  const int64_t whole = K - K % C::width;
  for (int64_t k = 0; k < whole; k += C::width)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = C::full(acc[i][j], x + i * K + k, w + j * K + k);
  if (whole < K)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = C::step(acc[i][j], x + i * K + whole, w + j * K + whole, K - whole);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float v = fold(acc[i][j]);
      if (bias != nullptr) v += to_f32(bias[j]);
      out[i * ldo + j] = static_cast<T>(v);
    }
}

template <typename C, int MR>
inline void row_block(const typename C::T* x, const typename C::T* w, const typename C::T* bias,
                      typename C::T* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NR = 4;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<C, MR, NR>(x, w + n * K, bias ? bias + n : nullptr, out + n, K, N);
  for (; n < n1; ++n) tile<C, MR, 1>(x, w + n * K, bias ? bias + n : nullptr, out + n, K, N);
}

template <typename C>
void linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
            at::Tensor& out) {
  using T = typename C::T;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  // Threads split the columns only: a column block's weights (<= 64 rows of K)
  // stay in cache while every row of x passes over them.
  constexpr int64_t kColumnBlock = 64;
  const int64_t blocks = (N + kColumnBlock - 1) / kColumnBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kColumnBlock, n1 = std::min(N, n0 + kColumnBlock);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) row_block<C, 4>(xp + m * K, wp, bp, op + m * N, K, N, n0, n1);
      for (; m < M; ++m) row_block<C, 1>(xp + m * K, wp, bp, op + m * N, K, N, n0, n1);
    }
  });
}

// RMSNorm of one row in float32: the sum of squares in the linear layer's fixed order.
template <typename C>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  using T = typename C::T;
  const int64_t D = x.size(-1), rows = x.numel() / std::max<int64_t>(D, 1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * D;
      Acc acc = acc_zero();
      for (int64_t k = 0; k < D; k += C::width) acc = C::step(acc, row + k, row + k, D - k);
      const float inv = 1.0f / std::sqrt(fold(acc) / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t d = 0; d < D; ++d) op[r * D + d] = static_cast<T>(to_f32(row[d]) * inv * to_f32(wp[d]));
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "invariant kernels: ", what); }

void check_dtype(const at::Tensor& t) {
  check(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, "dtype must be float32 or bfloat16");
}

}  // namespace

at::Tensor invariant_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  check(x.dim() == 2 && w.dim() == 2, "x must be [M, K] and w [N, K]");
  check(x.size(1) == w.size(1), "x and w differ in K");
  check_dtype(x);
  check(x.scalar_type() == w.scalar_type(), "x and w must share a dtype");
  if (bias.has_value()) {
    check(bias->dim() == 1 && bias->size(0) == w.size(0), "bias must be [N]");
    check(bias->scalar_type() == w.scalar_type(), "bias must share w's dtype");
  }
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  c10::optional<at::Tensor> bc;
  if (bias.has_value()) bc = bias->contiguous();
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    linear<BF16Chunk>(xc, wc, bc, out);
  else
    linear<F32Chunk>(xc, wc, bc, out);
  return out;
}

at::Tensor invariant_rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must be [x.size(-1)]");
  check_dtype(x);
  check(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows<BF16Chunk>(xc, wc, eps, out);
  else
    rms_norm_rows<F32Chunk>(xc, wc, eps, out);
  return out;
}
