"""C++ kernels for the CPU backend, compiled on first use for the machine they run on.

The build goes through ``torch.utils.cpp_extension`` (a C++ compiler and
``ninja``, which the ``cpu`` extra installs) into torch's extension cache, so
later processes load the cached library at once. Each copy of the sources
builds in a folder of its own there (``build_directory``): two checkouts
side by side (a clean clone's CI beside a working tree) would otherwise
rebuild over each other whenever their paths differ. A process killed mid-build
leaves torch's lock file behind, which every later load would wait on for ever
(torch's lock has no owner and no timeout): so builds and loads also take a
``flock`` of their own on the folder, which the kernel drops when its holder
dies, and whoever holds it removes a torch lock it finds (its builder is gone).
Every ``.cpp`` file in this
directory goes into the one library: ``kernels.h`` declares each kernel and
``bindings.cpp`` (the only file with a ``PYBIND11_MODULE``, and the only one that includes
``<torch/extension.h>``: the others compile against ATen's lighter headers, so the first build takes
about a minute and a half on a 2-core machine, not four and a half) exposes it. Where the build is not
possible, ``load()`` returns None and says why in ``load_error()``; callers fall
back to the PyTorch reference kernels in ``kernels.reference``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
# Off switch, for comparing against the reference path and for machines where
# the build misbehaves.
DISABLE_ENV = "INFERFLUX_CPU_KERNELS"
# Which instruction set the kernels are built for. ``auto`` (the default): this machine's own
# (``-march=native``), so an AVX-512 server runs the AVX-512 kernels and an AVX2 laptop the AVX2 ones,
# chosen where it runs. ``avx512`` (x86-64-v4: AVX-512 F/BW/CD/DQ/VL, no BF16), ``avx2`` (x86-64-v3) and
# ``generic`` (plain x86-64, or the compiler's default elsewhere) build that level on purpose, each as a
# library of its own beside the automatic one: the tests run every level the host can run, and an operator
# can pin one (runtime.cpu_isa: a fleet of mixed CPUs, a suspected miscompile, a benchmark of one path).
ISA_ENV = "INFERFLUX_CPU_ISA"
ISAS = ("auto", "avx512", "avx2", "generic")
ALIASES = {"native": "auto"}  # the name the automatic level had before it was ``auto``

_lock = threading.Lock()
_modules: dict[str, ModuleType | None] = {}
_errors: dict[str, str] = {}
_chosen: str | None = None  # choose()'s level (runtime.cpu_isa), over the environment's


def check_isa(isa: str) -> str:
    """``isa`` as one of ``ISAS`` (``native`` is ``auto``); ValueError naming the choices."""
    name = isa.strip().lower() or "auto"
    name = ALIASES.get(name, name)
    if name not in ISAS:
        raise ValueError(f"CPU instruction set {isa!r}: one of {', '.join(ISAS)}")
    return name


def choose(isa: str) -> None:
    """Build and load ``isa``'s level from now on (the settings' ``runtime.cpu_isa``, before any model loads)."""
    global _chosen
    _chosen = check_isa(isa)


def requested_isa() -> str:
    """The level ``load()`` builds: ``choose()``'s, else ``INFERFLUX_CPU_ISA`` (``auto`` when unset);
    ValueError naming the choices."""
    if _chosen is not None:
        return _chosen
    try:
        return check_isa(os.environ.get(ISA_ENV, "auto"))
    except ValueError as exc:
        raise ValueError(f"{ISA_ENV}: {exc}") from None


_AVX2 = {"avx2", "fma", "f16c"}  # the flags of x86-64-v3's kernels (exact_lanes_avx2.h)
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4's


def _x86(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def host_isas(flags: set[str] | None = None) -> list[str]:
    """The levels this host can run (``flags``: /proc/cpuinfo's, read when None)."""
    flags = flags if flags is not None else cpu_flags()
    x86 = _x86()
    return ["auto", *(["avx512"] if x86 and _AVX512 <= flags else []), *(["avx2"] if x86 and _AVX2 <= flags else []),
            "generic"]


def expected_isa(flags: set[str], machine: str) -> str:
    """The level a native build reaches on a CPU with these /proc/cpuinfo flags (what ``isa()`` reports once
    built there): the choice ``auto`` then makes (backends/cpu/passes.py) follows from it, so it can be
    worked out, and tested, for CPUs this host is not."""
    if machine.lower() in ("aarch64", "arm64"):
        return "neon"
    if not _x86(machine):
        return "generic"
    if "avx512f" in flags:
        return "avx512-bf16" if {"avx512_bf16", "avx512bw"} <= flags else "avx512"
    return "avx2" if _AVX2 <= flags else "generic"


def native_bf16(flags: set[str]) -> bool:
    """Whether a CPU with these flags multiplies bfloat16 itself (AVX-512 BF16 or AMX): where ``auto`` loads it."""
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def cpu_flags() -> set[str]:
    """This host's /proc/cpuinfo flags (x86) or features (ARM); empty where there is no such file."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def load(isa: str | None = None) -> ModuleType | None:
    """The compiled kernels for ``isa`` (default: ``requested_isa()``), building them on the first call;
    None if unavailable (``load_error()`` says why)."""
    with _lock:
        try:
            isa = check_isa(isa) if isa else requested_isa()
        except ValueError:  # load_error() says why
            return None
        if isa not in _modules:
            try:
                _modules[isa] = _build(isa)
            except Exception as exc:  # a failed build must not stop serving: the reference path works
                _modules[isa] = None
                _errors[isa] = f"{type(exc).__name__}: {exc}".strip()
                log.warning("CPU kernels (%s) unavailable, using the PyTorch reference path: %s", isa, _errors[isa])
        return _modules[isa]


def load_error(isa: str | None = None) -> str | None:
    """Why ``load(isa)`` returned None (after it was called)."""
    try:
        isa = check_isa(isa) if isa else requested_isa()
    except ValueError as exc:
        return str(exc)
    return _errors.get(isa)


def isa() -> str:
    """The instruction set the loaded kernels were compiled for (``avx512-bf16``, ``avx512``, ``avx2``,
    ``neon``, ``generic``); empty where none are loaded."""
    module = _loaded_module()
    return str(module.build_isa()) if module is not None else ""


def sources() -> list[str]:
    """The C++ files of the extension: all of this directory's, in a stable order."""
    return [str(p) for p in sorted(SOURCE_DIR.glob("*.cpp"))]


def _march(isa: str) -> list[str]:
    if isa == "auto":
        return ["-march=native"]  # built on, and cached for, the machine that runs it
    levels = {"avx512": "x86-64-v4", "avx2": "x86-64-v3"}  # v4: AVX-512 F/BW/CD/DQ/VL; v3: AVX2, FMA, F16C, BMI2
    if isa in levels:
        if not _x86():
            raise RuntimeError(f"the {isa} level is x86-64's")
        return [f"-march={levels[isa]}"]
    return ["-march=x86-64"] if _x86() else []


def _build(isa: str = "auto") -> ModuleType:
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in {"0", "off", "false", "no"}:
        raise RuntimeError(f"disabled by {DISABLE_ENV}")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError("no C++ compiler on PATH (set CXX or install g++)")
    from torch.utils import cpp_extension

    name = extension_name(isa)
    folder = build_directory(name)
    with building(folder):
        return cpp_extension.load(
            name=name,
            sources=sources(),
            extra_cflags=["-O3", *_march(isa), "-fopenmp"],
            extra_include_paths=[str(SOURCE_DIR)],
            build_directory=str(folder),
            verbose=False,
        )


TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the build folder
BUILD_LOCK = "inferflux-build.lock"


@contextmanager
def building(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s build lock (waiting for another builder); a torch lock found then is stale.

    Every build and load of the folder happens under this ``flock``, so while it is held no other
    process can be inside torch's build: a torch lock file present then was left by a process that
    died holding it, and is removed instead of being waited on for ever.
    """
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's lock alone
        yield
        return
    with open(folder / BUILD_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / TORCH_LOCK
            if stale.exists():
                log.warning("removing %s: left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


EXTENSION = "inferflux_cpu_kernels"


def extension_name(isa: str = "auto") -> str:
    """The library's name for ``isa``: the automatic (native) build keeps the plain name."""
    return EXTENSION if isa == "auto" else f"{EXTENSION}_{isa}"


def build_directory(name: str = EXTENSION) -> Path:
    """This copy of the sources' folder in torch's extension cache (created): named after its path."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256(str(SOURCE_DIR.resolve()).encode()).hexdigest()[:12]
    path = Path(cpp_extension._get_build_directory(name, verbose=False)).with_name(f"{name}-{digest}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kernels.reference.paged_attention`` in place on the cache (same arguments and result).

    ``mask`` is accepted for the common signature and ignored: the kernel works
    out what each query may see from ``context_lens`` and ``query_start``.
    Call ``load()`` first; this raises if the kernels are unavailable.
    """
    return loaded().paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start, scale)


def qmatmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """``x @ W.T`` in float32, ``W`` given as ggml blocks ``uint8 [N, row_bytes]`` of type ``qtype``.

    Row ``m`` of the result depends only on row ``m`` of ``x`` (never on how many
    rows are in the call or where it sits): the batch-invariant matmul.
    """
    return loaded().qmatmul(x, blocks, qtype)


def exact_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """``x @ W.T`` in ``x``'s dtype (bfloat16 or float32), ``W`` as ggml blocks decoded to the loader's
    weights in that dtype: ``invariant_linear(x, W)``'s bits (so batch-invariant too), reading the blocks."""
    return loaded().exact_linear(x, blocks, qtype)


def exact_linear_supported(dtype: torch.dtype | None = None) -> bool:
    """Whether the kernels are loaded and ``exact_linear`` was built for rows of ``dtype`` (default
    bfloat16, which needs AVX-512 BF16; float32 rows run on every build)."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    if dtype not in (torch.bfloat16, torch.float32):
        return False
    module = _loaded_module()
    return module is not None and bool(module.exact_linear_supported(dtype == torch.bfloat16))


def dequantize_blocks(blocks: torch.Tensor, qtype: int, k: int, bf16: bool) -> torch.Tensor:
    """ggml blocks ``uint8 [N, row_bytes]`` as a dense ``[N, k]`` float32 (or bfloat16) tensor."""
    return loaded().dequantize_blocks(blocks, qtype, k, bf16)


def _loaded_module() -> ModuleType | None:
    try:
        return _modules.get(requested_isa())
    except ValueError:
        return None


def loaded() -> ModuleType:
    """The compiled module once ``load()`` has built it; raises (saying why) when it has not."""
    module = _loaded_module()
    if module is None:
        raise RuntimeError(f"CPU kernels are not loaded: {load_error() or 'call kernels.cpu.load() first'}")
    return module
