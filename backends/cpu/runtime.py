"""What the CPU backend sets in its process: glibc's malloc thresholds, libgomp's thread pools, the kernels'
instruction-set level and the bf16 check.

Each is a no-op where the library or the symbol is absent (another libc, another
OpenMP runtime), so the backend calls them unconditionally. torch is imported only
inside ``release_openmp_pool``.
"""

from __future__ import annotations

import ctypes
import os
import platform


def choose_isa(isa: str | None) -> None:
    """Pin the CPU kernels' instruction-set level (the settings' ``runtime.cpu_isa``) before any model loads;
    None leaves it to INFERFLUX_CPU_ISA, then ``auto``."""
    if isa is not None:
        from inferflux.kernels import cpu as cpu_kernels

        cpu_kernels.choose(isa)


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX), as /proc/cpuinfo says, and the
    kernels are built for it: a level pinned below (runtime.cpu_isa avx512, avx2, generic) has no bfloat16
    kernels, so it loads float32 as a CPU of that level would."""
    from inferflux.kernels import cpu as cpu_kernels  # stdlib only at import: the probe needs no torch

    try:
        automatic = cpu_kernels.requested_isa() == "auto"
    except ValueError:  # a bad INFERFLUX_CPU_ISA: the kernels' load_error() says so, and none load
        automatic = False
    return automatic and cpu_kernels.native_bf16(cpu_kernels.cpu_flags())


def release_freed_heap() -> bool:
    """Hand the heap's free pages back to the kernel once (glibc's malloc_trim), e.g. after
    the load passes dropped the dense copies of quantised weights; a no-op off glibc."""
    if platform.system() != "Linux":
        return False
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim(0) == 1
    except (OSError, AttributeError):
        return False


def keep_freed_memory() -> bool:
    """Stop glibc from returning large freed blocks to the kernel.

    Every step allocates and frees multi-megabyte temporaries (gathered K/V,
    activations). With glibc's defaults each one is a fresh mmap that is
    page-faulted in and unmapped again, which made decode attention 5x slower
    than the arithmetic. Raising the mmap and trim thresholds keeps those pages
    in the heap for reuse. Process-wide, harmless elsewhere; a no-op off glibc.
    """
    if platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1
    return libc.mallopt(m_trim_threshold, 1 << 30) == 1 and ok


def _torch_openmp_libraries() -> list[str]:
    import glob

    import torch

    return sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (libgomp); False if not possible.

    libgomp keeps one team of workers per thread that ever ran a parallel
    region. The model is loaded on one thread and run on the engine's: with
    the loader's team still alive, the engine's team got about 1.4 of 2 cores
    and a decode step ran ~25% slower (a bf16 [32x576]x[576x3072] matmul 460
    instead of 370 us, a parallel elementwise op 5x slower). OpenMP 5's
    ``omp_pause_resource_all`` frees only the caller's pool in libgomp, so
    other engines' threads are untouched. A no-op where the symbol is absent
    (another OpenMP runtime, or none).
    """
    pause = None
    for library in (None, *_torch_openmp_libraries()):  # torch may load libgomp privately
        try:
            pause = ctypes.CDLL(library).omp_pause_resource_all
            break
        except (OSError, AttributeError):
            continue
    if pause is None:
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    omp_pause_soft = 1
    return pause(omp_pause_soft) == 0
