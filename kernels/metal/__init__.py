"""Metal Shading Language kernels for the metal backend, wrapped as a kernel set.

``paged_attention`` and ``store_kv`` run our own shaders (``paged_attention.metal``,
``kv_store.metal``), compiled on first use through ``torch.mps.compile_shader``
once per element type; the other functions are ``kernels.reference``'s PyTorch
ops, which run on the mps device as they are.

``*_launch`` only marshals a call: the arguments in the order of the shader's
``[[buffer(i)]]`` parameters (tensors as buffers, Python ints as ``long``, floats
as ``float``) and the grid. It is pure Python, so the tests check it on any
machine against the parameter lists parsed from the ``.metal`` sources.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inferflux.kernels.contracts import check_paged_attention, check_store_kv
from inferflux.kernels.errors import KernelError
from inferflux.kernels.reference import add_rms_norm, apply_rope, apply_rope_interleaved, causal_attention, rms_norm, silu_and_mul

__all__ = [
    "add_rms_norm",
    "apply_rope",
    "apply_rope_interleaved",
    "causal_attention",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]

SOURCE_DIR = Path(__file__).parent
# The element type each torch dtype is compiled with (bfloat needs Metal 3.1, macOS 14).
MSL_TYPES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}
# paged_attention.metal's threadgroup: one SIMD group, each thread DIMS_PER_THREAD dimensions.
SIMD_WIDTH = 32
DIMS_PER_THREAD = 8
MAX_STORE_GROUP = 256  # threads per store_kv threadgroup, within every Apple GPU's limit

PAGED_ATTENTION_PARAMS = (
    "q", "k_cache", "v_cache", "block_tables", "context_lens", "query_start", "out",
    "scale", "q_len", "heads", "kv_heads", "head_dim", "block_size", "num_blocks", "max_blocks",
)
STORE_KV_PARAMS = ("k_cache", "v_cache", "k", "v", "slots", "kv_heads", "num_blocks", "block_size", "head_dim")


@dataclass(frozen=True)
class Launch:
    """One shader dispatch: ``threads`` in all, in threadgroups of ``group_size``."""

    source: str  # file under SOURCE_DIR
    kernel: str
    dtype: torch.dtype
    args: tuple[Any, ...]
    threads: tuple[int, int, int]
    group_size: tuple[int, int, int]


_lock = threading.Lock()
_libraries: dict[tuple[str, torch.dtype], Any] = {}


def library(source: str, dtype: torch.dtype) -> Any:
    """``source`` compiled for ``dtype`` (cached): needs macOS, an Apple GPU and torch's mps build."""
    with _lock:
        key = (source, dtype)
        if key not in _libraries:
            text = (SOURCE_DIR / source).read_text(encoding="utf-8")
            try:
                _libraries[key] = torch.mps.compile_shader(f"#define ELEM_T {MSL_TYPES[dtype]}\n{text}")
            except Exception as exc:  # compile errors surface as RuntimeError from the Metal compiler
                raise KernelError(f"cannot compile {source} for {dtype} with torch.mps: {exc}") from exc
        return _libraries[key]


def dispatch(launch: Launch) -> None:
    kernel = getattr(library(launch.source, launch.dtype), launch.kernel)
    kernel(*launch.args, threads=list(launch.threads), group_size=list(launch.group_size))


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
    """``kernels.reference.paged_attention``'s contract; ``mask`` is accepted and ignored
    (the shader derives causality from ``context_lens`` and ``query_start``)."""
    launch = paged_attention_launch(q, k_cache, v_cache, block_tables, context_lens, query_start, scale)
    out = launch.args[PAGED_ATTENTION_PARAMS.index("out")]
    if out.numel():
        dispatch(launch)
    return out


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """``kernels.reference.store_kv``'s contract; a negative slot writes nothing."""
    launch = store_kv_launch(k_cache, v_cache, k, v, slots)
    if k.numel():
        dispatch(launch)


def paged_attention_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
) -> Launch:
    """The dispatch of paged_attention.metal: one threadgroup per (query row, head)."""
    shape = check_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start)
    _check_contiguous("paged_attention", k_cache, v_cache)
    if shape.head_dim > SIMD_WIDTH * DIMS_PER_THREAD:
        raise KernelError(f"paged_attention: head_dim {shape.head_dim} is over the shader's "
                          f"{SIMD_WIDTH * DIMS_PER_THREAD}")
    values = {
        "q": q.contiguous(),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": _int32(block_tables),
        "context_lens": _int32(context_lens),
        "query_start": _int32(query_start),
        "out": torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "scale": float(scale),
        "q_len": shape.q_len,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "block_size": shape.block_size,
        "num_blocks": shape.num_blocks,
        "max_blocks": shape.max_blocks,
    }
    args = tuple(values[name] for name in PAGED_ATTENTION_PARAMS)
    return Launch("paged_attention.metal", "paged_attention", q.dtype, args,
                  threads=(SIMD_WIDTH, shape.heads, shape.num_seqs * shape.q_len), group_size=(SIMD_WIDTH, 1, 1))


def store_kv_launch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> Launch:
    """The dispatch of kv_store.metal: one thread per (dimension, KV head, token)."""
    check_store_kv(k_cache, v_cache, k, v, slots)
    _check_contiguous("store_kv", k_cache, v_cache)
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    tokens = slots.shape[0]
    values = {
        "k_cache": k_cache,
        "v_cache": v_cache,
        "k": k.contiguous(),  # usually views of the fused qkv projection
        "v": v.contiguous(),
        "slots": _int32(slots),
        "kv_heads": kv_heads,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "head_dim": head_dim,
    }
    args = tuple(values[name] for name in STORE_KV_PARAMS)
    return Launch("kv_store.metal", "store_kv", k.dtype, args,
                  threads=(head_dim, kv_heads, tokens), group_size=(min(head_dim, MAX_STORE_GROUP), 1, 1))


def _check_contiguous(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # The shaders index the caches as flat buffers.
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelError(f"{name}: the caches must be contiguous")


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()
