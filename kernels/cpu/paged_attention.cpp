// Paged attention for a few query tokens per sequence (decode steps and
// speculative verification), reading keys and values in place from the paged
// cache. The PyTorch reference gathers every sequence's blocks into a padded
// copy and runs two batched matmuls over it; at decode sizes that is memory
// traffic, not arithmetic, and the copy was most of it. Here each
// (sequence, KV head) pair streams its blocks once, scores every query of its
// group against each key while the row is hot, and accumulates the values the
// same way. Arithmetic is float32 whatever the cache holds.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {
  // bfloat16 is the top half of a float32: widen by shifting (vectorises well).
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// Sixteen independent partial sums folded as a tree: a plain reduction loop
// must keep the float additions in order, which compiles to a chain of
// dependent scalar adds that costs more than the multiplications.
constexpr int64_t kLanes = 16;

inline float dot(const float* a, const float* b, int64_t n) {
  float part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int64_t i = 0; i < kLanes; ++i) part[i] += a[d + i] * b[d + i];
  float tail = 0.f;
  for (; d < n; ++d) tail += a[d] * b[d];
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t i = 0; i < width; ++i) part[i] += part[i + width];
  return part[0] + tail;
}

// Blocks sit anywhere in the cache, so the hardware prefetcher loses the
// stream at every block boundary: ask for the next block while this one is used.
template <typename T>
inline void prefetch_block(const T* base, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(base);
  for (int64_t off = 0; off < elements * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// The context rows [0, span) of one (sequence, KV head), block by block:
// rows(cache, buf, fn) widens each row into buf and calls fn(position).
template <typename T>
struct BlockWalk {
  const int64_t* table;
  int64_t used_blocks, first_block, block_size, head_dim, span;

  template <typename Fn>
  void rows(const T* cache, float* buf, Fn&& fn) const {
    const int64_t block_elems = block_size * head_dim;
    for (int64_t b = 0; b < used_blocks; ++b) {
      if (b + 1 < used_blocks) prefetch_block(cache + (first_block + table[b + 1]) * block_elems, block_elems);
      const T* base = cache + (first_block + table[b]) * block_elems;
      for (int64_t i = 0; i < block_size && b * block_size + i < span; ++i) {
        widen(base + i * head_dim, buf, head_dim);
        fn(b * block_size + i);
      }
    }
  }
};

}  // namespace

namespace ifx {

template <typename T>
void paged_attention_rows(const T* qp, const T* kp, const T* vp, const int64_t* tables, const int64_t* lens,
                          const int64_t* starts, const PagedShape& shape, double scale, T* op) {
  const int64_t num_seqs = shape.num_seqs, q_len = shape.q_len, heads = shape.heads, head_dim = shape.head_dim;
  const int64_t kv_heads = shape.kv_heads, num_blocks = shape.num_blocks, block_size = shape.block_size;
  const int64_t group = heads / kv_heads, rows = q_len * group, max_blocks = shape.max_blocks;
  const float fscale = static_cast<float>(scale);

  // One work item per (sequence, KV head); contexts differ in length, so
  // small grains let the pool balance them.
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf, scores, acc, row(head_dim);
    std::vector<int64_t> limit(rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads;
      const int64_t ctx = lens[s];
      // Row r = j * group + g: query token j, head h * group + g. It may see
      // context positions below min(its own position + 1, ctx).
      int64_t span = 0;
      for (int64_t j = 0; j < q_len; ++j) {
        int64_t lim = std::min(starts[s] + j + 1, ctx);
        lim = std::max<int64_t>(lim, 0);
        for (int64_t g = 0; g < group; ++g) limit[j * group + g] = lim;
        span = std::max(span, lim);
      }
      qbuf.assign(rows * head_dim, 0.f);
      for (int64_t j = 0; j < q_len; ++j)
        for (int64_t g = 0; g < group; ++g) {
          const T* src = qp + s * shape.q_seq_stride + j * shape.q_tok_stride + (h * group + g) * head_dim;
          float* dst = qbuf.data() + (j * group + g) * head_dim;
          widen(src, dst, head_dim);
          for (int64_t d = 0; d < head_dim; ++d) dst[d] *= fscale;
        }
      scores.assign(rows * std::max<int64_t>(span, 1), -std::numeric_limits<float>::infinity());
      acc.assign(rows * head_dim, 0.f);

      const int64_t* table = tables + s * max_blocks;
      const int64_t used_blocks = std::min((span + block_size - 1) / block_size, max_blocks);
      const BlockWalk<T> walk{table, used_blocks, h * num_blocks, block_size, head_dim, span};
      walk.rows(kp, row.data(), [&](int64_t t) {
        for (int64_t r = 0; r < rows; ++r)
          if (t < limit[r]) scores[r * span + t] = dot(qbuf.data() + r * head_dim, row.data(), head_dim);
      });
      for (int64_t r = 0; r < rows; ++r) {  // softmax over what each row may see
        float* sr = scores.data() + r * span;
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < limit[r]; ++t) peak = std::max(peak, sr[t]);
        float total = 0.f;
        for (int64_t t = 0; t < limit[r]; ++t) {
          sr[t] = std::exp(sr[t] - peak);
          total += sr[t];
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t t = 0; t < limit[r]; ++t) sr[t] *= inv;
      }
      walk.rows(vp, row.data(), [&](int64_t t) {
        for (int64_t r = 0; r < rows; ++r)
          if (t < limit[r]) axpy(scores[r * span + t], row.data(), acc.data() + r * head_dim, head_dim);
      });
      for (int64_t j = 0; j < q_len; ++j)
        for (int64_t g = 0; g < group; ++g) {
          T* dst = op + ((s * q_len + j) * heads + h * group + g) * head_dim;
          const float* src = acc.data() + (j * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(src[d]);
        }
    }
  });
}

template void paged_attention_rows<float>(const float*, const float*, const float*, const int64_t*, const int64_t*,
                                         const int64_t*, const PagedShape&, double, float*);
template void paged_attention_rows<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                                                  const int64_t*, const int64_t*, const int64_t*, const PagedShape&,
                                                  double, c10::BFloat16*);

}  // namespace ifx

namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, "paged_attention: ", what); }

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& query_start,
         double scale, at::Tensor& out) {
  const ifx::PagedShape shape{q.size(0), q.size(1), q.size(2), q.size(3), q.size(1) * q.size(2) * q.size(3),
                              q.size(2) * q.size(3), k_cache.size(0), k_cache.size(1), k_cache.size(2),
                              block_tables.size(1)};
  ifx::paged_attention_rows<T>(q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                               block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                               query_start.data_ptr<int64_t>(), shape, scale, out.data_ptr<T>());
}

}  // namespace

at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                              at::Tensor block_tables, at::Tensor context_lens, at::Tensor query_start,
                              double scale) {
  check(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4, "q and the caches must be 4-D");
  check(k_cache.sizes() == v_cache.sizes(), "k and v caches differ in shape");
  check(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
        "q and the caches must share a dtype");
  check(q.size(3) == k_cache.size(3), "head_dim differs between q and the cache");
  check(q.size(2) % k_cache.size(0) == 0, "query heads must be a multiple of KV heads");
  check(block_tables.dim() == 2 && block_tables.size(0) == q.size(0), "block_tables must be [num_seqs, max_blocks]");
  check(context_lens.numel() == q.size(0) && query_start.numel() == q.size(0), "one length and start per sequence");
  check(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
            query_start.scalar_type() == at::kLong,
        "tables, lengths and starts must be int64");
  check(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto starts = query_start.contiguous();
  check(lens.numel() == 0 || tables.size(1) * k_cache.size(2) >= lens.max().item<int64_t>(),
        "a context is longer than its block table");
  check(tables.numel() == 0 || (tables.min().item<int64_t>() >= 0 && tables.max().item<int64_t>() < k_cache.size(1)),
        "a block table names a block outside the cache");
  auto out = at::empty_like(qc);
  if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(qc, k_cache, v_cache, tables, lens, starts, scale, out);
  } else {
    check(q.scalar_type() == at::kFloat, "dtype must be float32 or bfloat16");
    run<float>(qc, k_cache, v_cache, tables, lens, starts, scale, out);
  }
  return out;
}
