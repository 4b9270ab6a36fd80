// The C++ loop over layers for decode steps: every layer of a step of a few single-token rows
// in one call (backends/cpu/decode_loop.py packs the layers at load and decides which steps
// qualify). A projection is ggml blocks (multiplied by qmatmul, or in the exact mode by exact_linear below its
// threshold and its dense copy's op from there; a stack of blocks of several types in the blocks mode, each part
// by exact_linear) or a dense weight, multiplied by
// the op the Python path calls on it: oneDNN's linear on the weight packed once (linear.pack),
// or at::linear on a plain one.
//
// At one row a decode step's kernels take ~8 ms here, and the ~40 torch ops a layer that the
// Python path calls between them (each a dispatch, a temporary, Python in between) cost ~5 ms
// more. This loop calls the same kernels' inner functions (kernels.h, namespace ifx) on
// buffers allocated once per power of two of rows, so a layer costs its kernels and little else.
//
// Same kernels, same order, same rounding as Block.forward with kernels.cpu.fast, so a step's
// logits are the Python path's bits: add + RMSNorm (fused.cpp), qmatmul (rounded to the
// activation dtype, then + bias) or the dense projection's own op, RoPE on q and k together,
// the KV store (copies), paged attention (paged_attention.cpp), o_proj, add + RMSNorm,
// gate_up, SiLU(gate) * up, down.
// SiLU and the product are torch's own CPU kernels (at::cpu::silu_out / mul_out, called
// directly, not through the dispatcher) because the Python path runs F.silu, whose
// vectorised exp rounds differently from std::exp in the last bit now and then.
#pragma GCC optimize("fp-contract=off")  // the bias add rounds as torch's does

#include "kernels.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul_cpu_dispatch.h>
#include <ATen/ops/silu_cpu_dispatch.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <string>

namespace {

constexpr int kProjections = 4;  // qkv, o_proj, gate_up, down
constexpr int kTensorsPerLayer = 2 + 2 * kProjections;  // norms, projections' weights, biases

enum class Kind { kBlocks, kPacked, kDense };

struct Projection {
  at::Tensor weight;  // uint8 [out, row_bytes] blocks, or a dense [out, in] weight (packed for oneDNN or plain)
  at::Tensor bias;    // [out] of the activation dtype, or empty
  int64_t qtype = 0, out = 0, in = 0;
  Kind kind = Kind::kBlocks;
  // QuantLinear with ``exact`` (passes' exact mode): blocks multiplied by exact_linear below exact_below rows, and
  // from there ``dense`` (the same weights, packed for oneDNN or plain) by the op QuantLinear calls on it. The
  // blocks mode has no dense side: exact_below is then the largest int64, so every step takes exact_linear.
  at::Tensor dense;
  int64_t exact_below = 0;
  // A fused projection whose parts are blocks of different types (linear.StackedQuantLinear: Q4_K_M's v in Q6_K
  // beside q and k in Q4_K), in the blocks mode: each part multiplied by exact_linear into its columns. weight is
  // then empty; out is the parts' sum.
  std::vector<Projection> parts;
};

// linear.packed_linear's op: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "").
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, c10::string_view,
                            c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::string_view(""));
}

struct Layer {
  at::Tensor input_norm, post_norm;
  Projection proj[kProjections];
};

// One step's intermediate values: whole buffers of a power of two of rows, or their first M rows.
struct Buffers {
  at::Tensor h, res, qkv, qk, attn, o, gu, silu, act, down, yf;
  at::Tensor gate, up;  // gu's halves, the views F.silu and the product see in Python
};

class Loop {
 public:
  Loop(std::vector<at::Tensor> layers, std::vector<int64_t> qtypes, int64_t num_heads, int64_t num_kv_heads,
             int64_t head_dim, double eps, double scale, std::vector<at::Tensor> exact_dense,
             std::vector<int64_t> exact_below, std::vector<at::Tensor> part_weights, std::vector<int64_t> part_qtypes,
             std::vector<int64_t> part_of)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(static_cast<float>(eps)), scale_(scale) {
    TORCH_CHECK(!layers.empty() && layers.size() % kTensorsPerLayer == 0,
                "DecodeLoop: ", kTensorsPerLayer,
                " tensors a layer (2 norms, 4 projections: blocks or dense weights, 4 biases or empty)");
    TORCH_CHECK(qtypes.size() * kTensorsPerLayer == layers.size() * kProjections, "DecodeLoop: 4 qtypes a layer");
    TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "DecodeLoop: heads must be a multiple of KV heads");
    dtype_ = layers[0].scalar_type();
    TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16, "DecodeLoop: float32 or bfloat16 only");
    hidden_ = layers[0].size(0);
    const int64_t n = static_cast<int64_t>(layers.size()) / kTensorsPerLayer;
    for (int64_t l = 0; l < n; ++l) {
      const at::Tensor* t = &layers[l * kTensorsPerLayer];
      Layer layer;
      layer.input_norm = t[0].contiguous();
      layer.post_norm = t[1].contiguous();
      for (int p = 0; p < kProjections; ++p) {
        Projection& pr = layer.proj[p];
        pr.weight = t[2 + p];
        pr.bias = t[2 + kProjections + p];
        pr.qtype = qtypes[l * kProjections + p];
        pr.out = pr.weight.size(0);
        pr.kind = pr.weight.is_mkldnn() ? Kind::kPacked
                  : pr.weight.scalar_type() == at::kByte ? Kind::kBlocks
                                                              : Kind::kDense;
        TORCH_CHECK(pr.weight.dim() == 2 && (pr.kind == Kind::kPacked || pr.weight.is_contiguous()) &&
                        (pr.kind == Kind::kBlocks || pr.weight.scalar_type() == dtype_),
                    "DecodeLoop: a projection must be contiguous uint8 [out, row_bytes] blocks, or a dense "
                    "[out, in] weight (packed or plain) of the norms' dtype");
        TORCH_CHECK(pr.bias.numel() == 0 || (pr.bias.numel() == pr.out && pr.bias.scalar_type() == dtype_ &&
                                             pr.bias.is_contiguous()),
                    "DecodeLoop: a bias must be [out] of the norms' dtype");
      }
      layers_.push_back(std::move(layer));
    }
    TORCH_CHECK(exact_dense.size() == exact_below.size() &&
                    (exact_below.empty() || exact_below.size() == layers_.size() * kProjections),
                "DecodeLoop: exact_dense and exact_below hold one entry a projection, or none");
    for (size_t i = 0; i < exact_below.size(); ++i) {
      Projection& pr = layers_[i / kProjections].proj[i % kProjections];
      if (exact_below[i] <= 0) continue;
      TORCH_CHECK(pr.kind == Kind::kBlocks && ifx::exact_linear_supported(dtype_ == at::kBFloat16),
                  "DecodeLoop: exact_linear multiplies blocks by rows of the model's dtype, where it was built");
      const at::Tensor& d = exact_dense[i];
      if (!d.defined() || d.numel() == 0) {  // the blocks mode: nothing dense, exact_linear at every row count
        pr.exact_below = std::numeric_limits<int64_t>::max();
        continue;
      }
      TORCH_CHECK(d.dim() == 2 && d.size(0) == pr.out &&
                      (d.is_mkldnn() || (d.is_contiguous() && d.scalar_type() == dtype_)),
                  "DecodeLoop: an exact projection's dense side must be its [out, in] weight (packed or plain)");
      pr.dense = d;
      pr.exact_below = exact_below[i];
    }
    TORCH_CHECK(part_qtypes.size() == part_weights.size() && part_of.size() == part_weights.size(),
                "DecodeLoop: one qtype and one projection index a part");
    for (size_t i = 0; i < part_weights.size(); ++i) {
      TORCH_CHECK(part_of[i] >= 0 && part_of[i] < static_cast<int64_t>(layers_.size()) * kProjections,
                  "DecodeLoop: a part of a projection that is not there");
      Projection& pr = layers_[part_of[i] / kProjections].proj[part_of[i] % kProjections];
      TORCH_CHECK(pr.kind == Kind::kBlocks && pr.weight.numel() == 0 &&
                      pr.exact_below == std::numeric_limits<int64_t>::max(),
                  "DecodeLoop: a stacked projection is empty blocks beside its parts, exact_linear at every size");
      Projection part;
      part.weight = part_weights[i];
      part.qtype = part_qtypes[i];
      part.exact_below = pr.exact_below;
      TORCH_CHECK(part.weight.dim() == 2 && part.weight.scalar_type() == at::kByte && part.weight.is_contiguous(),
                  "DecodeLoop: a part must be contiguous uint8 [out, row_bytes] blocks");
      part.out = part.weight.size(0);
      pr.out += part.out;
      pr.parts.push_back(std::move(part));
    }
    const Layer& first = layers_[0];
    qkv_ = (heads_ + 2 * kv_heads_) * head_dim_;
    inter_ = first.proj[2].out / 2;
    const int64_t ins[kProjections] = {hidden_, heads_ * head_dim_, hidden_, inter_};
    const int64_t outs[kProjections] = {qkv_, hidden_, 2 * inter_, hidden_};
    for (Layer& layer : layers_) {
      TORCH_CHECK(layer.input_norm.numel() == hidden_ && layer.post_norm.numel() == hidden_ &&
                      layer.input_norm.scalar_type() == dtype_ && layer.post_norm.scalar_type() == dtype_,
                  "DecodeLoop: norms must be [hidden] of one dtype");
      for (int p = 0; p < kProjections; ++p) {
        Projection& pr = layer.proj[p];
        pr.in = ins[p];
        TORCH_CHECK(pr.out == outs[p], "DecodeLoop: projection ", p, " has ", pr.out, " outputs, expected ", outs[p]);
        if (pr.kind != Kind::kBlocks) {
          TORCH_CHECK(pr.weight.size(1) == pr.in, "DecodeLoop: projection ", p, " has ", pr.weight.size(1),
                      " inputs, expected ", pr.in);
        } else {  // dequantize_blocks' check of the row size (qtype and K), on a zero-row view, once at load.
          std::vector<Projection*> all_blocks{&pr};  // a stacked projection's: its parts'
          if (!pr.parts.empty()) {
            all_blocks.clear();
            for (Projection& part : pr.parts) all_blocks.push_back(&part);
          }
          for (Projection* blocks : all_blocks) {
            blocks->in = pr.in;
            dequantize_blocks(blocks->weight.narrow(0, 0, 0), blocks->qtype, pr.in, false);
            TORCH_CHECK(!ifx::is_k_type(blocks->qtype) || (blocks->exact_below > 0 && dtype_ == at::kFloat),
                        "DecodeLoop: Q4_K and Q6_K blocks are multiplied by exact_linear on float32 rows only");
          }
        }
      }
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  std::vector<at::Tensor> step(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                                  const std::vector<at::Tensor>& v_caches, const at::Tensor& slots,
                                  const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& tables,
                                  const at::Tensor& lens, const at::Tensor& starts) {
    const int64_t M = x.size(0);
    check_step(x, k_caches, v_caches, slots, cos, sin, tables, lens, starts);
    Buffers b = buffers(M);
    if (dtype_ == at::kBFloat16)
      run<at::BFloat16>(x, k_caches, v_caches, slots, cos, sin, tables, lens, starts, b);
    else
      run<float>(x, k_caches, v_caches, slots, cos, sin, tables, lens, starts, b);
    return {b.down, b.res};
  }

 private:
  // in: this step's buffer [M, pr.in] holding the projection's input.
  template <typename T>
  void project(const Projection& pr, const at::Tensor& in_t, int64_t M, float* yf, T* out) {
    if (pr.kind != Kind::kBlocks) {  // the Python path's own op on the same tensors, so the same bits
      c10::optional<at::Tensor> bias;
      if (pr.bias.numel()) bias = pr.bias;
      dense_op(pr.weight, in_t, bias, M, pr.out, out);
      return;
    }
    // QuantLinear.forward: the product in the activation dtype, then + bias in that dtype.
    if (!pr.parts.empty()) {  // StackedQuantLinear.forward: each part's product into its columns (yf as scratch)
      T* part_out = reinterpret_cast<T*>(yf);
      int64_t column = 0;
      for (const Projection& part : pr.parts) {
        ifx::exact_linear_rows(in_t.data_ptr<T>(), M, pr.in, part.weight.data_ptr<uint8_t>(), part.out,
                               part.weight.size(1), part.qtype, part_out);
        for (int64_t m = 0; m < M; ++m)
          std::memcpy(out + m * pr.out + column, part_out + m * part.out, part.out * sizeof(T));
        column += part.out;
      }
    } else if (pr.exact_below > 0 && M >= pr.exact_below) {  // exact's dense side
      dense_op(pr.dense, in_t, c10::nullopt, M, pr.out, out);
    } else if (pr.exact_below > 0) {
      ifx::exact_linear_rows(in_t.data_ptr<T>(), M, pr.in, pr.weight.data_ptr<uint8_t>(), pr.out, pr.weight.size(1),
                             pr.qtype, out);
    } else {
      ifx::qmatmul_rows(in_t.data_ptr<T>(), M, pr.in, pr.weight.data_ptr<uint8_t>(), pr.out, pr.weight.size(1),
                        pr.qtype, yf, scratch_);
      for (int64_t i = 0; i < M * pr.out; ++i) out[i] = static_cast<T>(yf[i]);  // the float32 product, rounded
    }
    if (pr.bias.numel()) {
      const T* bias = pr.bias.data_ptr<T>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < pr.out; ++n)
          out[m * pr.out + n] = static_cast<T>(static_cast<float>(out[m * pr.out + n]) + static_cast<float>(bias[n]));
    }
  }

  // A dense weight's op, the one its forward calls (oneDNN's on a packed weight, at::linear on a plain one),
  // copied into out.
  template <typename T>
  static void dense_op(const at::Tensor& weight, const at::Tensor& in_t,
                       const c10::optional<at::Tensor>& bias, int64_t M, int64_t N, T* out) {
    const at::Tensor y = weight.is_mkldnn() ? packed_linear(in_t, weight, bias) : at::linear(in_t, weight, bias);
    std::memcpy(out, y.contiguous().data_ptr<T>(), M * N * sizeof(T));
  }

  template <typename T>
  void run(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
           const std::vector<at::Tensor>& v_caches, const at::Tensor& slots, const at::Tensor& cos,
           const at::Tensor& sin, const at::Tensor& tables, const at::Tensor& lens,
           const at::Tensor& starts, Buffers& b) {
    const int64_t M = x.size(0), D = head_dim_, qk_heads = heads_ + kv_heads_;
    const int64_t num_blocks = k_caches[0].size(1), block_size = k_caches[0].size(2);
    T *h = b.h.data_ptr<T>(), *res = b.res.data_ptr<T>(), *qkv = b.qkv.data_ptr<T>(), *qk = b.qk.data_ptr<T>();
    T *attn = b.attn.data_ptr<T>(), *o = b.o.data_ptr<T>(), *gu = b.gu.data_ptr<T>(), *down = b.down.data_ptr<T>();
    float* yf = b.yf.data_ptr<float>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    // q is the first heads_ of each qk row: a row stride of qk_heads * D.
    const ifx::PagedShape qshape{M, 1, heads_, D, qk_heads * D, qk_heads * D, kv_heads_, num_blocks, block_size,
                                 tables.size(1)};
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      if (l == 0)  // Block.forward's first layer: no residual yet, the embedding is it
        ifx::add_rms_norm_rows(x.data_ptr<T>(), static_cast<const T*>(nullptr), L.input_norm.data_ptr<T>(), M,
                               hidden_, eps_, h, res);
      else
        ifx::add_rms_norm_rows(down, res, L.input_norm.data_ptr<T>(), M, hidden_, eps_, h, res);
      project(L.proj[0], b.h, M, yf, qkv);
      // q and k are adjacent in the fused projection: rotated together, into qk [M, heads + kv_heads, D].
      ifx::rope_rows(qkv, M, qk_heads, D, qkv_, D, cos.data_ptr<T>(), sin.data_ptr<T>(), qk);
      T* kc = k_caches[l].data_ptr<T>();
      T* vc = v_caches[l].data_ptr<T>();
      for (int64_t m = 0; m < M; ++m)  // store_kv: k after RoPE, v as projected
        for (int64_t g = 0; g < kv_heads_; ++g) {
          const int64_t at = (g * num_blocks * block_size + slot[m]) * D;
          std::memcpy(kc + at, qk + (m * qk_heads + heads_ + g) * D, D * sizeof(T));
          std::memcpy(vc + at, qkv + m * qkv_ + (heads_ + kv_heads_ + g) * D, D * sizeof(T));
        }
      ifx::paged_attention_rows(static_cast<const T*>(qk), static_cast<const T*>(kc), static_cast<const T*>(vc),
                                tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                                qshape, scale_, attn);
      project(L.proj[1], b.attn, M, yf, o);
      ifx::add_rms_norm_rows(static_cast<const T*>(o), static_cast<const T*>(res), L.post_norm.data_ptr<T>(), M,
                             hidden_, eps_, h, res);
      project(L.proj[2], b.h, M, yf, gu);
      at::cpu::silu_out(b.silu, b.gate);
      at::cpu::mul_out(b.act, b.silu, b.up);
      project(L.proj[3], b.act, M, yf, down);
    }
  }

  // The step's buffers: views of M rows into buffers allocated once per power of two of rows (at most
  // eight sizes up to the engine's 64 rows, instead of one allocation per row count seen).
  Buffers buffers(int64_t M) {
    int64_t cap = 1;
    while (cap < M) cap *= 2;
    auto it = buffers_.find(cap);
    if (it == buffers_.end()) {
      const auto opt = at::TensorOptions().dtype(dtype_);
      Buffers b;
      b.h = at::empty({cap, hidden_}, opt);
      b.res = at::empty({cap, hidden_}, opt);
      b.qkv = at::empty({cap, qkv_}, opt);
      b.qk = at::empty({cap, heads_ + kv_heads_, head_dim_}, opt);
      b.attn = at::empty({cap, heads_ * head_dim_}, opt);
      b.o = at::empty({cap, hidden_}, opt);
      b.gu = at::empty({cap, 2 * inter_}, opt);
      b.silu = at::empty({cap, inter_}, opt);
      b.act = at::empty({cap, inter_}, opt);
      b.down = at::empty({cap, hidden_}, opt);
      b.yf = at::empty({cap, std::max({qkv_, hidden_, 2 * inter_})}, opt.dtype(at::kFloat));
      it = buffers_.emplace(cap, std::move(b)).first;
    }
    const Buffers& all = it->second;
    Buffers b;  // the first M rows of each: contiguous, as the kernels and the dense ops need them
    for (auto [view, whole] : {std::pair{&b.h, &all.h}, {&b.res, &all.res}, {&b.qkv, &all.qkv}, {&b.qk, &all.qk},
                               {&b.attn, &all.attn}, {&b.o, &all.o}, {&b.gu, &all.gu}, {&b.silu, &all.silu},
                               {&b.act, &all.act}, {&b.down, &all.down}, {&b.yf, &all.yf}})
      *view = whole->narrow(0, 0, M);
    b.gate = b.gu.narrow(1, 0, inter_);
    b.up = b.gu.narrow(1, inter_, inter_);
    return b;
  }

  void check_step(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                  const std::vector<at::Tensor>& v_caches, const at::Tensor& slots, const at::Tensor& cos,
                  const at::Tensor& sin, const at::Tensor& tables, const at::Tensor& lens,
                  const at::Tensor& starts) const {
    const int64_t M = x.size(0);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == dtype_ && x.is_contiguous() && M > 0,
                "DecodeLoop: x must be contiguous [rows, hidden] of the model's dtype");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers() && v_caches.size() == k_caches.size(),
                "DecodeLoop: one k and one v cache a layer");
    const auto shape = k_caches[0].sizes();
    for (size_t l = 0; l < k_caches.size(); ++l)
      TORCH_CHECK(k_caches[l].dim() == 4 && k_caches[l].sizes() == shape && v_caches[l].sizes() == shape &&
                      k_caches[l].is_contiguous() && v_caches[l].is_contiguous() &&
                      k_caches[l].scalar_type() == dtype_ && v_caches[l].scalar_type() == dtype_ &&
                      shape[0] == kv_heads_ && shape[3] == head_dim_,
                  "DecodeLoop: caches must be contiguous [kv_heads, blocks, block_size, head_dim] of the model's dtype");
    const int64_t blocks = shape[1], block_size = shape[2];
    auto long_rows = [&](const at::Tensor& t, const char* name) {
      TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == M, "DecodeLoop: ", name,
                  " must be contiguous int64 [rows]");
    };
    long_rows(slots, "slots");
    long_rows(lens, "lens");
    long_rows(starts, "starts");
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == M && tables.scalar_type() == at::kLong &&
                    tables.is_contiguous(),
                "DecodeLoop: tables must be contiguous int64 [rows, max_blocks]");
    for (const auto* t : {&cos, &sin})
      TORCH_CHECK(t->numel() == M * head_dim_ && t->scalar_type() == dtype_ && t->is_contiguous(),
                  "DecodeLoop: cos/sin must be contiguous [rows, 1, head_dim] of the model's dtype");
    const int64_t* tp = tables.data_ptr<int64_t>();
    for (int64_t i = 0; i < tables.numel(); ++i)
      TORCH_CHECK(tp[i] >= 0 && tp[i] < blocks, "DecodeLoop: a block table names a block outside the cache");
    const int64_t *sp = slots.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>(), *st = starts.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(sp[m] >= 0 && sp[m] < blocks * block_size, "DecodeLoop: a slot outside the cache");
      TORCH_CHECK(lp[m] >= 1 && lp[m] <= tables.size(1) * block_size && st[m] == lp[m] - 1,
                  "DecodeLoop: a context longer than its block table, or not a single-token step");
    }
  }

  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_, hidden_ = 0, qkv_ = 0, inter_ = 0;
  float eps_;
  double scale_;
  at::ScalarType dtype_ = at::kFloat;
  std::map<int64_t, Buffers> buffers_;
  ifx::QScratch scratch_;
};

}  // namespace

struct DecodeLoop::Impl : Loop {
  using Loop::Loop;
};

DecodeLoop::DecodeLoop(std::vector<at::Tensor> layers, std::vector<int64_t> qtypes, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                       std::vector<at::Tensor> exact_dense, std::vector<int64_t> exact_below,
                       std::vector<at::Tensor> part_weights, std::vector<int64_t> part_qtypes,
                       std::vector<int64_t> part_of)
    : impl_(std::make_unique<Impl>(std::move(layers), std::move(qtypes), num_heads, num_kv_heads, head_dim, eps,
                                   scale, std::move(exact_dense), std::move(exact_below), std::move(part_weights),
                                   std::move(part_qtypes), std::move(part_of))) {}

DecodeLoop::~DecodeLoop() = default;

int64_t DecodeLoop::num_layers() const { return impl_->num_layers(); }

std::vector<at::Tensor> DecodeLoop::step(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                                         const std::vector<at::Tensor>& v_caches, const at::Tensor& slots,
                                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& tables,
                                         const at::Tensor& lens, const at::Tensor& starts) {
  return impl_->step(x, k_caches, v_caches, slots, cos, sin, tables, lens, starts);
}
