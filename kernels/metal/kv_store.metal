// New keys and values into their paged cache slots, for the metal backend.
// kernels/metal/__init__.py compiles it with ELEM_T defined as float, half or
// bfloat, and launches it.
//
// k and v are [tokens, kv_heads, head_dim], the caches [kv_heads, num_blocks,
// block_size, head_dim], all contiguous; slots [tokens] int32, a token's slot
// being block * block_size + offset (kernels/reference.py). One thread per
// (dimension, KV head, token); a negative slot (padding) writes nothing.

#include <metal_stdlib>
using namespace metal;

typedef ELEM_T elem_t;

kernel void store_kv(
    device elem_t* k_cache [[buffer(0)]],
    device elem_t* v_cache [[buffer(1)]],
    device const elem_t* k [[buffer(2)]],
    device const elem_t* v [[buffer(3)]],
    device const int* slots [[buffer(4)]],
    constant long& kv_heads [[buffer(5)]],
    constant long& num_blocks [[buffer(6)]],
    constant long& block_size [[buffer(7)]],
    constant long& head_dim [[buffer(8)]],
    uint3 pos [[thread_position_in_grid]]) {
  const long d = pos.x;
  const long kv_head = pos.y;
  const long token = pos.z;
  const long slot = long(slots[token]);
  if (d >= head_dim || slot < 0) {
    return;
  }
  const long dst = ((kv_head * num_blocks + slot / block_size) * block_size + slot % block_size) * head_dim + d;
  const long src = (token * kv_heads + kv_head) * head_dim + d;
  k_cache[dst] = k[src];
  v_cache[dst] = v[src];
}
