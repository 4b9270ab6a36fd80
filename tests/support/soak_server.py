"""``inferctl serve`` with a memory probe, for the soak test and ``benchmarks/bench_soak.py``.

Run as ``python tests/support/soak_server.py serve <serve arguments>``. On SIGUSR1 the
process collects garbage, gives free heap back to the kernel (``malloc_trim``)
and writes a JSON report to ``$INFERFLUX_SOAK_REPORT``: its RSS, the bytes it
holds from malloc and the blocks Python's object allocator has handed out, the count of
live gc-tracked objects per type, and (with ``INFERFLUX_SOAK_TRACE=1``) the
lines whose tracemalloc allocations grew most since the previous report
(tracing starts at the first report). The
probe lives here rather than in the gateway so the product has no such door.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import json
import os
import signal
import sys
import tracemalloc
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
TOP_TYPES = 40

_previous: tracemalloc.Snapshot | None = None


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of ``pid`` from /proc (pages times the page size)."""
    with open(f"/proc/{pid}/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@functools.cache  # find_library runs ldconfig: once per process, not twice per probe
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name is not None else None


def malloc_trim() -> bool:
    """glibc's malloc_trim(0): return free heap pages of every arena to the kernel."""
    return bool(getattr(_libc(), "malloc_trim", lambda _pad: 0)(0))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def malloc_in_use() -> int | None:
    """Bytes the process holds from malloc (glibc's mallinfo2: in-use chunks plus mmapped ones).

    Unlike RSS this does not move when the allocator's arenas grow, fragment or
    are trimmed: it counts what the program has allocated and not freed, so a
    native leak (a tensor, a C++ buffer) shows in it and allocator noise does
    not. None where the C library has no mallinfo2 (glibc before 2.33, musl, macOS).
    """
    mallinfo2 = getattr(_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _type_counts() -> dict[str, int]:
    counts = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
    return dict(counts.most_common())


def _trace_growth() -> list[str]:
    global _previous
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    grown: list[str] = []
    if _previous is not None:
        for stat in snapshot.compare_to(_previous, "lineno")[:15]:
            grown.append(str(stat))
    _previous = snapshot
    return grown


def report(_signum: int = 0, _frame: FrameType | None = None) -> None:
    gc.collect()
    before_trim = rss_bytes()
    trimmed = malloc_trim()
    data: dict[str, Any] = {
        "rss_before_trim": before_trim,
        "rss": rss_bytes(),
        "trimmed": trimmed,
        "types": _type_counts(),
        "threads": len(os.listdir("/proc/self/task")),
        # What the program holds, without the allocators' noise in RSS: the blocks Python's object
        # allocator has handed out and not freed (a count), and malloc's in-use bytes.
        "python_blocks": sys.getallocatedblocks(),
        "malloc_in_use": malloc_in_use(),
    }
    if os.environ.get("INFERFLUX_SOAK_TRACE") == "1" and not tracemalloc.is_tracing():
        tracemalloc.start(8)  # from the first report on: tracing the model's loading takes minutes
    if tracemalloc.is_tracing():
        data["traced_bytes"] = tracemalloc.get_traced_memory()[0]
        data["grown"] = _trace_growth()
    target = Path(os.environ["INFERFLUX_SOAK_REPORT"])
    temp = target.with_name(target.name + ".tmp")
    temp.write_text(json.dumps(data))
    os.replace(temp, target)  # the reader polls for the file: never let it see half of it


def main() -> int:
    signal.signal(signal.SIGUSR1, report)
    from inferflux.gateway.cli import main as inferctl

    return inferctl(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
