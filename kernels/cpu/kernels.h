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
