// Fused elementwise kernels of a decoder layer: residual add + RMSNorm, RoPE on q and k
// together, SiLU(gate) * up. Each replaces 3 to 9 PyTorch ops (and their dispatch and
// temporaries) with one pass over the rows; at batch 1 a decode step is mostly such
// small ops, so their count, not their arithmetic, sets the step time.
//
// Numerics follow kernels/reference.py: every elementwise result is rounded to the
// activation dtype where the reference rounds it (bfloat16 products, sums), so RoPE and
// SiLU*up give the reference's bits; the RMSNorm reduction runs in float32 in one fixed
// order per row (16 interleaved partial sums, then those in index order), whatever the
// number of rows or threads: batch-invariant, and within rounding of the reference.
#pragma GCC optimize("fp-contract=off")  // no FMA contraction: products round as the reference's do

#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace {

constexpr int kLanes = 16;

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

}  // namespace

namespace ifx {

template <typename T>
void add_rms_norm_rows(const T* xp, const T* rp, const T* wp, int64_t rows, int64_t n, float eps, T* op, T* np) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * n;
      T* nr = np + r * n;
      if (rp != nullptr) {
        const T* rr = rp + r * n;
        for (int64_t i = 0; i < n; ++i) nr[i] = round_to<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
      } else if (nr != xr) {
        for (int64_t i = 0; i < n; ++i) nr[i] = xr[i];
      }
      float acc[kLanes] = {0.f};
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes)
        for (int j = 0; j < kLanes; ++j) {
          const float v = static_cast<float>(nr[i + j]);
          acc[j] += v * v;
        }
      for (int j = 0; i < n; ++i, ++j) {
        const float v = static_cast<float>(nr[i]);
        acc[j] += v * v;
      }
      float sum = 0.f;
      for (int j = 0; j < kLanes; ++j) sum += acc[j];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
      T* orow = op + r * n;
      for (int64_t k = 0; k < n; ++k) orow[k] = round_to<T>(static_cast<float>(nr[k]) * inv * static_cast<float>(wp[k]));
    }
  });
}

template <typename T>
void rope_rows(const T* xp, int64_t tokens, int64_t heads, int64_t dim, int64_t row_stride, int64_t head_stride,
               const T* cp, const T* sp, T* op) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * dim;
      const T* s = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* in = xp + t * row_stride + h * head_stride;
        T* o = op + (t * heads + h) * dim;
        for (int64_t k = 0; k < half; ++k) {
          const float x1 = static_cast<float>(in[k]), x2 = static_cast<float>(in[k + half]);
          // x * cos + rotate_half(x) * sin, each product rounded as the reference rounds it.
          const float a = static_cast<float>(round_to<T>(x1 * static_cast<float>(c[k])));
          const float b = static_cast<float>(round_to<T>(-x2 * static_cast<float>(s[k])));
          o[k] = round_to<T>(a + b);
          const float a2 = static_cast<float>(round_to<T>(x2 * static_cast<float>(c[k + half])));
          const float b2 = static_cast<float>(round_to<T>(x1 * static_cast<float>(s[k + half])));
          o[k + half] = round_to<T>(a2 + b2);
        }
      }
    }
  });
}

template void add_rms_norm_rows<float>(const float*, const float*, const float*, int64_t, int64_t, float, float*,
                                       float*);
template void add_rms_norm_rows<at::BFloat16>(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, int64_t,
                                              int64_t, float, at::BFloat16*, at::BFloat16*);
template void rope_rows<float>(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, const float*,
                               float*);
template void rope_rows<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                      const at::BFloat16*, const at::BFloat16*, at::BFloat16*);

}  // namespace ifx

namespace {

template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), n = out.size(1);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * 2 * n;
      const T* u = g + n;
      T* o = op + r * n;
      for (int64_t k = 0; k < n; ++k) {
        const float x = static_cast<float>(g[k]);
        const float silu = static_cast<float>(round_to<T>(x / (1.f + std::exp(-x))));
        o[k] = round_to<T>(silu * static_cast<float>(u[k]));
      }
    }
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": float32 or bfloat16 only, got ", x.scalar_type());
}

}  // namespace

std::vector<at::Tensor> fused_add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual,
                                              at::Tensor weight, double eps) {
  check_rows(x, "fused_add_rms_norm");
  TORCH_CHECK(x.dim() == 2, "fused_add_rms_norm: x must be [rows, hidden], got ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: weight must be [hidden] of x's dtype");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  at::Tensor rc, new_residual;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "fused_add_rms_norm: residual must match x");
    rc = residual->contiguous();
    new_residual = at::empty_like(xc);
  } else {
    new_residual = xc;  // no add: the residual is x itself
  }
  const float e = static_cast<float>(eps);
  const int64_t rows = xc.size(0), n = xc.size(1);
  if (xc.scalar_type() == at::kBFloat16)
    ifx::add_rms_norm_rows<at::BFloat16>(xc.data_ptr<at::BFloat16>(),
                                         residual.has_value() ? rc.data_ptr<at::BFloat16>() : nullptr,
                                         wc.data_ptr<at::BFloat16>(), rows, n, e, out.data_ptr<at::BFloat16>(),
                                         new_residual.data_ptr<at::BFloat16>());
  else
    ifx::add_rms_norm_rows<float>(xc.data_ptr<float>(), residual.has_value() ? rc.data_ptr<float>() : nullptr,
                                  wc.data_ptr<float>(), rows, n, e, out.data_ptr<float>(),
                                  new_residual.data_ptr<float>());
  return {out, new_residual};
}

at::Tensor fused_rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_rows(x, "fused_rope");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "fused_rope: x must be [tokens, heads, even head_dim]");
  TORCH_CHECK(x.stride(2) == 1, "fused_rope: x's head_dim must be contiguous");
  const auto t = x.size(0), d = x.size(2);
  TORCH_CHECK(cos.numel() == t * d && sin.numel() == t * d && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "fused_rope: cos/sin must be [tokens, 1, head_dim] of x's dtype");
  auto cc = cos.contiguous();
  auto sc = sin.contiguous();
  auto out = at::empty({t, x.size(1), d}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    ifx::rope_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), t, x.size(1), d, x.stride(0), x.stride(1),
                                 cc.data_ptr<at::BFloat16>(), sc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  else
    ifx::rope_rows<float>(x.data_ptr<float>(), t, x.size(1), d, x.stride(0), x.stride(1), cc.data_ptr<float>(),
                          sc.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

at::Tensor fused_silu_and_mul(at::Tensor gate_up) {
  check_rows(gate_up, "fused_silu_and_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "fused_silu_and_mul: gate_up must be [rows, 2 * n]");
  auto gc = gate_up.contiguous();
  auto out = at::empty({gc.size(0), gc.size(1) / 2}, gc.options());
  if (gc.scalar_type() == at::kBFloat16)
    silu_mul_rows<at::BFloat16>(gc, out);
  else
    silu_mul_rows<float>(gc, out);
  return out;
}
