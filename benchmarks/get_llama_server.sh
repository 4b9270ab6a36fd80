#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the peer for benchmarks/bench_serving.py) and
# `llama-perplexity` (the accuracy peer for benchmarks/bench_perplexity.py) from the
# llama.cpp source vendored inside the PyPI source distribution of llama-cpp-python.
#
# Only PyPI is contacted (via pip). The embedded web UI is disabled: recent llama.cpp
# otherwise tries to download prebuilt UI assets from huggingface.co at build time.
# Everything is built outside the repo, under
#   ${INFERFLUX_CACHE:-~/.cache/inferflux}/llama.cpp/
# Idempotent: if both binaries already exist, it only prints their paths.
#
# Env overrides:
#   PIP                   pip to use (default: <repo>/.venv/bin/pip, else `python3 -m pip`)
#   LLAMA_CPP_PY_VERSION  pin an sdist version, e.g. 0.3.16 (default: latest on PyPI)
#   JOBS                  parallel build jobs (default: 2)
#   LLAMA_AMX             1: keep ggml's AMX kernels on a CPU with AMX (default: built without)
#   LLAMA_ISA             native (default) or avx2: an AVX2 + FMA + F16C build with AVX-512 off, for comparing
#                         InferFlux's avx2 level (runtime.cpu_isa) on an AVX-512 host; it goes to build-avx2/
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${INFERFLUX_CACHE:-$HOME/.cache/inferflux}/llama.cpp"
ISA="${LLAMA_ISA:-native}"
case "$ISA" in
  native) BUILD="$CACHE/build"; ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) BUILD="$CACHE/build-avx2"
        ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                   -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF) ;;
  *) echo "error: LLAMA_ISA is native or avx2, not $ISA" >&2; exit 1 ;;
esac
BIN="$BUILD/bin/llama-server"
PPL_BIN="$BUILD/bin/llama-perplexity"
JOBS="${JOBS:-2}"

if [[ -x "$BIN" && -x "$PPL_BIN" ]]; then
  echo "llama-server already built: $BIN"
  echo "llama-perplexity already built: $PPL_BIN"
  exit 0
fi

for tool in cmake c++ tar; do
  command -v "$tool" >/dev/null || { echo "error: '$tool' is required" >&2; exit 1; }
done

if [[ -n "${PIP:-}" ]]; then
  read -r -a PIPCMD <<<"$PIP"
elif [[ -x "$REPO_ROOT/.venv/bin/pip" ]]; then
  PIPCMD=("$REPO_ROOT/.venv/bin/pip")
else
  PIPCMD=(python3 -m pip)
fi

SPEC="llama-cpp-python${LLAMA_CPP_PY_VERSION:+==$LLAMA_CPP_PY_VERSION}"
DL="$CACHE/sdist"
mkdir -p "$DL"
if ! ls "$DL"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  echo "[get_llama_server] downloading sdist $SPEC from PyPI ..."
  # --no-binary is scoped to llama-cpp-python (not :all:) so that pip may take its
  # *build* dependencies (scikit-build-core, used only to read the sdist's metadata)
  # as wheels instead of compiling setuptools/hatchling/... from source recursively.
  "${PIPCMD[@]}" download --no-deps --no-binary llama-cpp-python "$SPEC" -d "$DL"
fi
SDIST="$(ls -1 "$DL"/llama_cpp_python-*.tar.gz | sort -V | tail -n 1)"
echo "[get_llama_server] sdist: $SDIST"

# Extract the vendored llama.cpp tree into $CACHE/src (re-extract, and drop the build
# dir, only when the sdist changed; an interrupted build resumes where it stopped).
if [[ ! -f "$CACHE/src/CMakeLists.txt" || "$(cat "$CACHE/SOURCE" 2>/dev/null)" != "$(basename "$SDIST")" ]]; then
  rm -rf "$CACHE/src" "$CACHE/extract" "$CACHE/build" "$CACHE/build-avx2"
  mkdir -p "$CACHE/extract"
  tar -xzf "$SDIST" -C "$CACHE/extract"
  TOP="$(find "$CACHE/extract" -mindepth 1 -maxdepth 1 -type d | head -n 1)"
  if [[ ! -f "$TOP/vendor/llama.cpp/CMakeLists.txt" ]]; then
    echo "error: $SDIST does not contain vendor/llama.cpp" >&2; exit 1
  fi
  mv "$TOP/vendor/llama.cpp" "$CACHE/src"
  rm -rf "$CACHE/extract"
  basename "$SDIST" > "$CACHE/SOURCE"
fi

# ggml's AMX path (compiled in by -march=native where the CPU lists amx_tile) died with
# SIGILL at its first tile instruction ('tilezero %tmm6') on the 2-core Intel Xeon VM of
# 2026-11-26, although a plain tile-load/zero/release test program ran there. So on such a
# CPU it is built without AMX (the AVX-512 VNNI kernels, as on CPUs without AMX);
# LLAMA_AMX=1 keeps it. Binaries already built are kept as they are (the check at the top):
# delete $CACHE/build (or build-avx2) to rebuild with other flags.
NO_AMX=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null && [[ "${LLAMA_AMX:-0}" != "1" ]]; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi

echo "[get_llama_server] configuring (Release, $ISA CPU${NO_AMX:+ without AMX}, no curl) ..."
start=$(date +%s)
nice -n 19 cmake -S "$CACHE/src" -B "$BUILD" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS="$NO_AMX" \
  -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DLLAMA_CURL=OFF \
  "${ISA_FLAGS[@]}" \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF \
  -DBUILD_SHARED_LIBS=OFF
echo "[get_llama_server] building targets llama-server llama-perplexity with -j$JOBS (nice 19) ..."
nice -n 19 cmake --build "$BUILD" --config Release --target llama-server llama-perplexity -j"$JOBS"
end=$(date +%s)

for b in "$BIN" "$PPL_BIN"; do
  [[ -x "$b" ]] || { echo "error: build finished but $b is missing" >&2; exit 1; }
done
echo "[get_llama_server] build took $((end - start)) s"
"$BIN" --version 2>&1 | head -n 4 || true
echo "llama-server built: $BIN"
echo "llama-perplexity built: $PPL_BIN"
