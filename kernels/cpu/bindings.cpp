// The Python module of the CPU kernels: one m.def per kernel declared in kernels.h.
#include "kernels.h"

#include <torch/extension.h>  // the only file that needs it: pybind11 and its tensor casters

// The instruction set this library was compiled for (kernels.cpu.isa()).
static const char* build_isa() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return "avx512-bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "avx2";
#elif defined(__ARM_NEON)
  return "neon";
#else
  return "generic";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("build_isa", &build_isa, "the instruction set this library was compiled for");
  m.def("paged_attention", &paged_attention,
        "Causal attention of a few query tokens per sequence over the paged KV cache");
  m.def("qmatmul", &qmatmul, "x @ W^T with W in ggml blocks (Q4_0, Q4_1, Q8_0), batch-invariant per row");
  m.def("dequantize_blocks", &dequantize_blocks,
        "ggml blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) to a dense float32/bfloat16 matrix");
  m.def("exact_linear", &exact_linear,
        "bfloat16 or float32 x @ W^T with W in ggml blocks (Q4_0, Q4_1, Q8_0; Q4_K, Q6_K with float32 x) decoded "
        "to the loader's weights: invariant_linear's bits");
  m.def("exact_linear_supported", &ifx::exact_linear_supported,
        "whether exact_linear was built for bfloat16 rows (AVX-512 BF16) or float32 rows (every build)",
        pybind11::arg("bf16") = true);
  m.def("invariant_linear", &invariant_linear, "Batch-invariant x @ w^T (+ bias): a fixed reduction order per element",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias") = pybind11::none());
  m.def("invariant_rms_norm", &invariant_rms_norm, "RMSNorm per row in float32, in a fixed order");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual + x, then RMSNorm per row: {normalised, residual}",
        pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("fused_rope", &fused_rope, "Half-split RoPE of [tokens, heads, head_dim] in one pass");
  m.def("fused_silu_and_mul", &fused_silu_and_mul, "SiLU(gate) * up in one pass");
  // module_local: each instruction-set level is a library of its own, and a process may load two (the tests
  // compare them); a class registered globally by the first would refuse the second's.
  pybind11::class_<DecodeLoop>(m, "DecodeLoop", pybind11::module_local(),
                               "Every layer of a decode step of a few single-token rows in one call (decode_loop.cpp)")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t, double, double,
                          std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>,
                          std::vector<int64_t>>(),
           pybind11::arg("layers"), pybind11::arg("qtypes"), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"), pybind11::arg("scale"),
           pybind11::arg("exact_dense") = std::vector<at::Tensor>(),
           pybind11::arg("exact_below") = std::vector<int64_t>(),
           pybind11::arg("part_weights") = std::vector<at::Tensor>(),
           pybind11::arg("part_qtypes") = std::vector<int64_t>(), pybind11::arg("part_of") = std::vector<int64_t>())
      .def_property_readonly("num_layers", &DecodeLoop::num_layers)
      .def("step", &DecodeLoop::step, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "x [rows, hidden] -> [hidden states, residual] after the last layer (the loop's own buffers)");
}
