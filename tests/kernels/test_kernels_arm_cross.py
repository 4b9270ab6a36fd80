"""exact_linear's float32 core on ARM64, where no aarch64 torch build is at hand: the torch-free core
(kernels/cpu/exact_core.cpp, NEON lanes) and its standalone driver (kernels/cpu/driver/exact_driver.cpp) are
compiled with Debian's aarch64 cross compiler for ARMv8-A and for ARMv8.2-A with dotprod, run under qemu-user,
and each output compared bit for bit with invariant_linear's, computed here by the host's extension on the
loader's decoded weights (backends/models/quants.py); the driver's decoded weights must be those bits too. The
same driver built for the host with the portable lanes is held to the same bits. Random blocks of each type and
rows of the SmolLM2 model's own tensors; 1-4 rows take the register path, 5 and 17 the grouped one.

qemu checks bits, not speed: ARM speed is not measured here. The tools come from Debian (g++-aarch64-linux-gnu,
qemu-user; ``.ci/run`` installs them when missing). Outside CI a machine without them skips this test, saying
so; under CI (``$CI`` set, e.g. ``CI=true``) it fails."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from inferflux.backends.models.quants import dequantize, random_k_blocks
from inferflux.kernels import cpu as cpu_kernels

pytestmark = [
    pytest.mark.slow,  # three compiler runs and qemu
    pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ CPU kernels are not built here"),
]

CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # the cross toolchain's libc, for qemu's dynamic loader
CORE = [cpu_kernels.SOURCE_DIR / "driver" / "exact_driver.cpp", cpu_kernels.SOURCE_DIR / "exact_core.cpp"]
# name: (compiler, flags, the lanes the core must report). -O3 and no other flag, as the extension builds it: the
# sources' own pragma turns off fp-contract.
BUILDS = {
    "armv8-a": (CROSS_CXX, ["-march=armv8-a"], "neon"),
    "armv8.2-a+dotprod": (CROSS_CXX, ["-march=armv8.2-a+dotprod"], "neon"),
    "host-portable": (os.environ.get("CXX", "c++"), ["-DIFX_EXACT_PORTABLE"], "portable"),
}
QTYPES = {2: GGMLQuantizationType.Q4_0, 3: GGMLQuantizationType.Q4_1, 8: GGMLQuantizationType.Q8_0,
          12: GGMLQuantizationType.Q4_K, 14: GGMLQuantizationType.Q6_K}  # fmt: skip
ROWS = (1, 2, 3, 4, 5, 17)  # the register path (1-4) and the grouped one, its pairs and an odd row
MODEL_TENSORS = ("blk.0.attn_q.weight", "blk.29.ffn_down.weight", "token_embd.weight")  # Q4_1, Q4_1, Q8_0


def _tools_or_skip() -> None:
    missing = [tool for tool in (CROSS_CXX, QEMU) if shutil.which(tool) is None]
    missing += [] if (SYSROOT / "lib").is_dir() else [f"{SYSROOT}/lib"]
    if missing:
        reason = (f"no {', '.join(missing)} (apt-get install g++-aarch64-linux-gnu qemu-user; .ci/run does)")
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):  # as tests/conftest.py reads $CI
            pytest.fail(f"the ARM cross-check cannot run under CI: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def drivers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Each build's command line (qemu first for ARM), compiled once for the module, the builds side by side."""
    _tools_or_skip()
    folder = tmp_path_factory.mktemp("arm-cross")
    builds, commands = {}, {}
    for name, (cxx, flags, _) in BUILDS.items():
        binary = folder / f"exact_driver-{name}"
        builds[name] = subprocess.Popen([cxx, "-std=c++17", "-O3", *flags, "-I", str(cpu_kernels.SOURCE_DIR),
                                         *map(str, CORE), "-o", str(binary)], stderr=subprocess.PIPE, text=True)  # fmt: skip
        commands[name] = ([QEMU, "-L", str(SYSROOT)] if cxx == CROSS_CXX else []) + [str(binary)]
    for name, build in builds.items():
        _, errors = build.communicate(timeout=300)
        assert build.returncode == 0, f"{name}: {errors}"
    for name, (_, _, lanes) in BUILDS.items():
        isa = subprocess.run([*commands[name], "isa"], check=True, capture_output=True, text=True, timeout=60)
        assert isa.stdout.strip() == lanes, (name, isa.stdout)  # the NEON lanes, not a silent portable fallback
    return commands


class Case:
    """One multiplication for the driver: x [M, K], blocks [N, row_bytes], and the expected bits."""

    def __init__(self, qtype: int, x: np.ndarray, blocks: np.ndarray, dense: torch.Tensor, span: int = 0) -> None:
        self.qtype, self.x, self.blocks, self.dense, self.span = qtype, x, blocks, dense, span
        self.want = cpu_kernels.loaded().invariant_linear(torch.from_numpy(x), dense, None)

    def encode(self) -> bytes:
        (m, k), (n, row_bytes) = self.x.shape, self.blocks.shape
        return (struct.pack("<6q", self.qtype, m, k, n, row_bytes, self.span) + self.x.astype("<f4").tobytes()
                + np.ascontiguousarray(self.blocks).tobytes())  # fmt: skip

    def output_bytes(self) -> int:
        (m, k), n = self.x.shape, self.blocks.shape[0]
        return 4 * (m * n + n * k)


@pytest.fixture(scope="module")
def random_cases() -> list[Case]:
    """Random blocks of each type, at each row count (the expected bits computed once for every build)."""
    cases = []
    rng = np.random.default_rng(45)
    for qtype, kind in QTYPES.items():
        n, k = 37, 512 if qtype in (12, 14) else 576  # an odd N: the register path's and the group's last output
        if qtype in (12, 14):
            raw = random_k_blocks(kind, n, k, rng)  # float16 scales down into the subnormals
        else:
            w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
            w[0, :32] += 3.0  # one block with a large minimum and scale
            raw = np.ascontiguousarray(quants.quantize(w, kind)).view(np.uint8).reshape(n, -1)
        dense = torch.from_numpy(dequantize(raw.reshape(-1), qtype, (n, k)))
        x = rng.standard_normal((max(ROWS), k)).astype(np.float32)
        cases += [Case(qtype, x[:rows], raw, dense) for rows in ROWS]
        cases.append(Case(qtype, x[:5], raw, dense, span=5))  # outputs split unevenly, as threads may split them
    return cases


@pytest.fixture(scope="module")
def model_cases() -> list[Case]:
    """A few rows of three of the model's own tensors, picked at random."""
    from gguf import GGUFReader

    from inferflux.backends.models import default_model_path

    tensors = {t.name: t for t in GGUFReader(default_model_path()).tensors}
    rng = np.random.default_rng(9)
    cases = []
    for name in MODEL_TENSORS:
        t = tensors[name]
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        n, k, qtype = int(t.shape[1]), int(t.shape[0]), int(t.tensor_type)
        picked = np.sort(rng.choice(n, size=19, replace=False))  # a few rows of the tensor, anywhere in it
        blocks = raw.reshape(n, -1)[picked]
        dense = torch.from_numpy(dequantize(blocks.reshape(-1), qtype, (len(picked), k)))
        x = rng.standard_normal((5, k)).astype(np.float32)
        cases += [Case(qtype, x[:rows], blocks, dense) for rows in (1, 3, 5)]
    return cases


def _run(command: list[str], cases: list[Case], folder: Path) -> None:
    """Runs the driver over the cases and compares every output's bits."""
    request, answer = folder / "cases.bin", folder / "out.bin"
    request.write_bytes(b"".join(case.encode() for case in cases))
    done = subprocess.run([*command, "linear", str(request), str(answer)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data, offset = answer.read_bytes(), 0
    assert len(data) == sum(case.output_bytes() for case in cases)
    for case in cases:
        (m, k), n = case.x.shape, case.blocks.shape[0]
        y = np.frombuffer(data, "<f4", m * n, offset).reshape(m, n)
        decoded = np.frombuffer(data, "<f4", n * k, offset + 4 * m * n).reshape(n, k)
        offset += case.output_bytes()
        what = f"type {case.qtype}, {m} rows, span {case.span}"
        assert np.array_equal(decoded.view(np.uint32), case.dense.numpy().view(np.uint32)), f"decoded weights: {what}"
        assert np.array_equal(y.view(np.uint32), case.want.numpy().view(np.uint32)), f"y: {what}"


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_each_build_gives_invariant_linears_bits(
    build: str, drivers: dict[str, list[str]], random_cases: list[Case], tmp_path: Path
) -> None:
    _run(drivers[build], random_cases, tmp_path)


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_each_build_gives_its_bits_on_the_models_own_tensors(
    build: str, drivers: dict[str, list[str]], model_cases: list[Case], tmp_path: Path
) -> None:
    _run(drivers[build], model_cases, tmp_path)


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_the_portable_float16_conversion_is_exact_for_every_half(
    build: str, drivers: dict[str, list[str]], tmp_path: Path
) -> None:
    """ifx::half_to_float (exact_core.h) on all 65536 patterns: numpy's float32 for every non-NaN (subnormals,
    zeros and infinities included), and a NaN with its sign and payload, made quiet."""
    out = tmp_path / "halves.bin"
    subprocess.run([*drivers[build], "halves", str(out)], check=True, capture_output=True, timeout=60)
    got = np.frombuffer(out.read_bytes(), "<u4")
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    want = halves.astype(np.float32).view(np.uint32) | np.where(np.isnan(halves), np.uint32(0x00400000), np.uint32(0))
    assert got.shape == want.shape and np.array_equal(got, want)


def test_a_malformed_case_is_refused(drivers: dict[str, list[str]], tmp_path: Path) -> None:
    request = tmp_path / "bad.bin"
    request.write_bytes(struct.pack("<6q", 13, 1, 256, 1, 176, 0))  # Q5_K: a type the core does not read
    done = subprocess.run([*drivers["host-portable"], "linear", str(request), str(tmp_path / "out.bin")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "malformed case" in done.stderr


def test_the_extensions_sources_compile_for_arm64() -> None:
    """Every C++ file of the torch extension but bindings.cpp (which needs the target's Python headers) passes
    the aarch64 compiler against this torch's ATen headers: no x86 header or intrinsic outside its guards (an
    unguarded <immintrin.h> in qmatmul.cpp once made the extension unbuildable on ARM). Syntax only: no aarch64
    torch is at hand to link or run it."""
    _tools_or_skip()
    from torch.utils import cpp_extension

    includes = [flag for path in cpp_extension.include_paths() for flag in ("-I", path)]
    sources = [path for path in cpu_kernels.sources() if not path.endswith("bindings.cpp")]
    assert any(path.endswith("exact_f32.cpp") for path in sources)
    checks = {path: subprocess.Popen([CROSS_CXX, "-std=c++17", "-fsyntax-only", "-w", "-march=armv8-a", "-I",
                                      str(cpu_kernels.SOURCE_DIR), *includes, path],
                                     stderr=subprocess.PIPE, text=True) for path in sources}  # fmt: skip
    failed = {}
    for path, check in checks.items():
        _, errors = check.communicate(timeout=300)
        if check.returncode != 0:
            failed[Path(path).name] = errors[-2000:]
    assert not failed, failed
