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

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None
_tried = False


def load() -> ModuleType | None:
    """The compiled kernels, building them on the first call; None if unavailable."""
    global _module, _error, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _module = _build()
            except Exception as exc:  # a failed build must not stop serving: the reference path works
                _error = f"{type(exc).__name__}: {exc}".strip()
                log.warning("CPU kernels unavailable, using the PyTorch reference path: %s", _error)
        return _module


def load_error() -> str | None:
    """Why ``load()`` returned None (after it was called)."""
    return _error


def sources() -> list[str]:
    """The C++ files of the extension: all of this directory's, in a stable order."""
    return [str(p) for p in sorted(SOURCE_DIR.glob("*.cpp"))]


def _build() -> ModuleType:
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in {"0", "off", "false", "no"}:
        raise RuntimeError(f"disabled by {DISABLE_ENV}")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError("no C++ compiler on PATH (set CXX or install g++)")
    from torch.utils import cpp_extension

    folder = build_directory()
    with building(folder):
        # -march=native: the library is built on, and cached for, the machine that runs it.
        return cpp_extension.load(
            name=EXTENSION,
            sources=sources(),
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
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


def build_directory() -> Path:
    """This copy of the sources' folder in torch's extension cache (created): named after its path."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256(str(SOURCE_DIR.resolve()).encode()).hexdigest()[:12]
    path = Path(cpp_extension._get_build_directory(EXTENSION, verbose=False)).with_name(f"{EXTENSION}-{digest}")
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
    bfloat16, which needs AVX-512 BF16; float32 needs AVX-512F)."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    if dtype not in (torch.bfloat16, torch.float32):
        return False
    return _module is not None and bool(_module.exact_linear_supported(dtype == torch.bfloat16))


def dequantize_blocks(blocks: torch.Tensor, qtype: int, k: int, bf16: bool) -> torch.Tensor:
    """ggml blocks ``uint8 [N, row_bytes]`` as a dense ``[N, k]`` float32 (or bfloat16) tensor."""
    return loaded().dequantize_blocks(blocks, qtype, k, bf16)


def loaded() -> ModuleType:
    """The compiled module once ``load()`` has built it; raises (saying why) when it has not."""
    if _module is None:
        raise RuntimeError(f"CPU kernels are not loaded: {_error or 'call kernels.cpu.load() first'}")
    return _module
