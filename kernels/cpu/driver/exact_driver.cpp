// A standalone driver of exact_linear's torch-free float32 core (../exact_core.cpp), for machines with no torch
// build: tests/kernels/test_kernels_arm_cross.py compiles it with Debian's aarch64 cross compiler and runs it under
// qemu-user, to check the NEON kernels' bits against invariant_linear's computed on the host. It builds with
//   c++ -std=c++17 -O3 [-march=...] -I kernels/cpu kernels/cpu/driver/exact_driver.cpp kernels/cpu/exact_core.cpp
//
//   exact_driver isa            prints the lanes the core was compiled with (avx2, neon, portable)
//   exact_driver halves OUT     writes half_to_float of all 65536 float16 bit patterns (float32, in order)
//   exact_driver linear IN OUT  multiplies each case in IN, writing its y [M, N] and decoded weights [N, K]
//
// IN holds cases one after another, little-endian: six int64 (qtype, M, K, N, row_bytes, span), then x as
// float32 [M, K], then the blocks as uint8 [N, row_bytes]. The outputs are computed span outputs at a time, as a
// thread of the extension would take them (span 0: the extension's own grain for M rows).
#include "exact_core.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

int fail(const char* what) {
  std::fprintf(stderr, "exact_driver: %s\n", what);
  return 2;
}

bool read_all(std::FILE* f, void* p, size_t bytes) { return std::fread(p, 1, bytes, f) == bytes; }
bool write_all(std::FILE* f, const void* p, size_t bytes) { return std::fwrite(p, 1, bytes, f) == bytes; }

// One case from in to out; false at the end of in (nothing read) or on a malformed case (*error set).
bool one_case(std::FILE* in, std::FILE* out, const char** error) {
  int64_t h[6];
  if (std::fread(h, sizeof(int64_t), 6, in) != 6) return false;
  const int64_t qtype = h[0], M = h[1], K = h[2], N = h[3], row_bytes = h[4];
  const int64_t values = ifx::block_values(qtype);
  if (ifx::block_bytes(qtype) == 0 || M < 0 || N < 0 || K <= 0 || K % values != 0 ||
      row_bytes != K / values * ifx::block_bytes(qtype) || h[5] < 0) {
    *error = "a malformed case (unknown type, or shapes that do not match its blocks)";
    return false;
  }
  const int64_t span = h[5] > 0 ? h[5] : ifx::exact_rows_grain(M);
  std::vector<float> x(M * K), y(M * N), decoded(N * K);
  std::vector<uint8_t> w(N * row_bytes);
  if (!read_all(in, x.data(), x.size() * 4) || !read_all(in, w.data(), w.size())) {
    *error = "a case cut short";
    return false;
  }
  for (int64_t n0 = 0; n0 < N; n0 += span) {
    const int64_t n1 = n0 + span < N ? n0 + span : N;
    ifx::exact_rows_f32(x.data(), M, K, w.data(), row_bytes, qtype, n0, n1, y.data(), N);
  }
  ifx::decode_rows_f32(w.data(), qtype, row_bytes, K, 0, N, decoded.data());
  if (!write_all(out, y.data(), y.size() * 4) || !write_all(out, decoded.data(), decoded.size() * 4)) {
    *error = "cannot write the output";
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "isa") == 0) {
    std::printf("%s\n", ifx::exact_core_isa());
    return 0;
  }
  if (argc == 3 && std::strcmp(argv[1], "halves") == 0) {
    std::FILE* out = std::fopen(argv[2], "wb");
    if (out == nullptr) return fail("cannot open the output");
    for (uint32_t h = 0; h < 65536; ++h) {
      const float f = ifx::half_to_float(static_cast<uint16_t>(h));
      if (!write_all(out, &f, 4)) return fail("cannot write the output");
    }
    return std::fclose(out) == 0 ? 0 : fail("cannot write the output");
  }
  if (argc != 4 || std::strcmp(argv[1], "linear") != 0) return fail("usage: exact_driver isa | halves OUT | linear IN OUT");
  std::FILE* in = std::fopen(argv[2], "rb");
  std::FILE* out = std::fopen(argv[3], "wb");
  if (in == nullptr || out == nullptr) return fail("cannot open the input or the output");
  const char* error = nullptr;
  int cases = 0;
  while (one_case(in, out, &error)) ++cases;
  std::fclose(in);
  if (std::fclose(out) != 0) return fail("cannot write the output");
  if (error != nullptr) return fail(error);
  std::printf("%d cases\n", cases);
  return 0;
}
