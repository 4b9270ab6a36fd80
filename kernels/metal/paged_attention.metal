// Causal attention over the paged KV cache, for the metal backend's decode steps
// (and prefill chunks after cached context). kernels/metal/__init__.py compiles it
// with ELEM_T defined as float, half or bfloat, and launches it.
//
// Layouts (kernels/reference.py): q and out [num_seqs, q_len, heads, head_dim];
// k_cache and v_cache [kv_heads, num_blocks, block_size, head_dim]; block_tables
// [num_seqs, max_blocks]; context_lens and query_start [num_seqs]. All contiguous,
// indices int32.
//
// One threadgroup of SIMD_WIDTH threads, one SIMD group, per (query row, head),
// a query row being one query token of one sequence. The threads split head_dim
// between them, so a score is one simd_sum, and the context is walked position by
// position through the block table with an online softmax in float: a running
// max m, a running sum l and the unnormalised output acc, rescaled as m grows.
// Query j of a sequence sits at position query_start + j and sees positions
// 0 .. min(query_start + j, context_len - 1). GQA: query head h reads KV head
// h / (heads / kv_heads).

#include <metal_stdlib>
using namespace metal;

typedef ELEM_T elem_t;

constant constexpr uint SIMD_WIDTH = 32;
constant constexpr uint DIMS_PER_THREAD = 8;  // head_dim up to SIMD_WIDTH * DIMS_PER_THREAD = 256

kernel void paged_attention(
    device const elem_t* q [[buffer(0)]],
    device const elem_t* k_cache [[buffer(1)]],
    device const elem_t* v_cache [[buffer(2)]],
    device const int* block_tables [[buffer(3)]],
    device const int* context_lens [[buffer(4)]],
    device const int* query_start [[buffer(5)]],
    device elem_t* out [[buffer(6)]],
    constant float& scale [[buffer(7)]],
    constant long& q_len [[buffer(8)]],
    constant long& heads [[buffer(9)]],
    constant long& kv_heads [[buffer(10)]],
    constant long& head_dim [[buffer(11)]],
    constant long& block_size [[buffer(12)]],
    constant long& num_blocks [[buffer(13)]],
    constant long& max_blocks [[buffer(14)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long head = group.y;
  const long row = group.z;  // sequence * q_len + query index
  const long seq = row / q_len;
  const long kv_head = head / (heads / kv_heads);
  const long position = long(query_start[seq]) + row % q_len;
  const long context_len = long(context_lens[seq]);
  const long visible = position + 1 < context_len ? position + 1 : context_len;

  device const elem_t* q_row = q + (row * heads + head) * head_dim;
  float qv[DIMS_PER_THREAD];
  float acc[DIMS_PER_THREAD];
  for (uint i = 0; i < DIMS_PER_THREAD; ++i) {
    const long d = lane + i * SIMD_WIDTH;
    qv[i] = d < head_dim ? float(q_row[d]) * scale : 0.0f;
    acc[i] = 0.0f;
  }
  // A finite start: Metal compiles with fast math, where infinities are not to be relied on.
  float m = -1.0e30f;
  float l = 0.0f;
  device const int* table = block_tables + seq * max_blocks;
  for (long t = 0; t < visible; ++t) {
    const long block = long(table[t / block_size]);
    const long base = ((kv_head * num_blocks + block) * block_size + t % block_size) * head_dim;
    float partial = 0.0f;
    for (uint i = 0; i < DIMS_PER_THREAD; ++i) {
      const long d = lane + i * SIMD_WIDTH;
      if (d < head_dim) {
        partial += qv[i] * float(k_cache[base + d]);
      }
    }
    const float score = simd_sum(partial);  // every lane gets the whole dot product
    const float m_new = max(m, score);
    const float rescale = exp(m - m_new);
    const float p = exp(score - m_new);
    l = l * rescale + p;
    for (uint i = 0; i < DIMS_PER_THREAD; ++i) {
      const long d = lane + i * SIMD_WIDTH;
      const float v = d < head_dim ? float(v_cache[base + d]) : 0.0f;
      acc[i] = acc[i] * rescale + p * v;
    }
    m = m_new;
  }
  // A row that sees no position (an empty context) gets zeros, as the Triton kernel gives.
  const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
  device elem_t* out_row = out + (row * heads + head) * head_dim;
  for (uint i = 0; i < DIMS_PER_THREAD; ++i) {
    const long d = lane + i * SIMD_WIDTH;
    if (d < head_dim) {
      out_row[d] = elem_t(acc[i] * inv_l);
    }
  }
}
