// Every C++ kernel of the CPU extension, declared once. Each kernel lives in its
// own .cpp file in this directory (kernels/cpu/__init__.py compiles all of them
// into one library); bindings.cpp, the only file with a PYBIND11_MODULE, exposes
// each with one m.def line. Adding a kernel: its .cpp, a declaration here, a line there.
#pragma once

#include <torch/extension.h>

// paged_attention.cpp: causal attention of a few query tokens per sequence over the paged KV cache.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor context_lens, torch::Tensor query_start,
                              double scale);

// qmatmul.cpp: y = x @ W^T (float32 [M, N]) with W as ggml blocks (uint8 [N, row_bytes]) of type qtype
// (ggml's ids: Q4_0 = 2, Q4_1 = 3, Q8_0 = 8); each row's result is independent of M and of its position.
torch::Tensor qmatmul(torch::Tensor x, torch::Tensor w, int64_t qtype);
// qmatmul.cpp: ggml blocks to a dense [N, K] tensor, float32 or (bf16) bfloat16.
torch::Tensor dequantize_blocks(torch::Tensor w, int64_t qtype, int64_t K, bool bf16);

// invariant.cpp: batch-invariant y = x @ w^T (+ bias), x [M, K], w [N, K], float32 or bfloat16 (the dtype of x);
// each element reduced over K in one fixed order, so a row's result never depends on M, its position or threads.
torch::Tensor invariant_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
// invariant.cpp: RMSNorm over the last dimension, each row in float32 in the same fixed order.
torch::Tensor invariant_rms_norm(torch::Tensor x, torch::Tensor weight, double eps);

// fused.cpp: the layer's elementwise ops in one pass each (kernels.cpu.fast, the default kernel set).
// residual + x (rounded to the dtype), then RMSNorm of it per row in float32 in a fixed order; no residual: x.
// Returns {normalised, new residual}.
std::vector<torch::Tensor> fused_add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                              torch::Tensor weight, double eps);
// fused.cpp: half-split RoPE of x [tokens, heads, head_dim] (rows may be strided) with cos/sin [tokens, 1, head_dim].
torch::Tensor fused_rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
// fused.cpp: SiLU(gate) * up of gate_up [rows, 2 * n] -> [rows, n].
torch::Tensor fused_silu_and_mul(torch::Tensor gate_up);
