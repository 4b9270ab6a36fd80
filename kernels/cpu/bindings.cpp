// The Python module of the CPU kernels: one m.def per kernel declared in kernels.h.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Causal attention of a few query tokens per sequence over the paged KV cache");
}
