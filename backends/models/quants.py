"""Dequantisation of ggml tensor types: the ``gguf`` package's dequantisers, and ours where faster.

``gguf.quants.dequantize`` (the package that also reads the file) decodes every type we
accept. For some types a vectorised kernel of ours below is kept because it is faster:
``benchmarks/bench_dequant.py`` times each one against gguf's in the same process, and a
kernel stays only for a type where it wins (numbers in docs/benchmarks.md, "Kernels and weights on the CPU").
The tests check every path, ours and gguf's, against gguf's decoding bit for bit.

Block layouts follow ggml (``ggml-common.h``); every block starts or ends with float16
scales, and weights are little-endian. Our kernels turn a 2-D ``uint8`` array of whole
blocks into float32 values, block by block, writing into a preallocated output, in chunks
of blocks so the temporaries of one chunk stay in cache: on a memory-bound box that is
what keeps the whole 135M default model under a second.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

QType = GGMLQuantizationType

# The types a model may be stored in: the ones the tests cover. gguf decodes more (Q2_K,
# Q3_K, the IQ types, ...); adding one here takes a test case and nothing else.
SUPPORTED_TYPES: frozenset[QType] = frozenset({
    QType.F32, QType.F16, QType.BF16,
    QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
    QType.Q4_K, QType.Q5_K, QType.Q6_K,
})

_CHUNK_ELEMENTS = 1 << 16  # 256 KiB of float32 output per chunk


class UnsupportedQuantType(ValueError):
    """The tensor is stored in a ggml type we do not load."""


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block, as a float32 column ``[n, 1]``."""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Low nibbles then high nibbles of each row: ggml puts element j in the low half of
    byte j and element j + n/2 in its high half."""
    out = np.empty((qs.shape[0], qs.shape[1] * 2), dtype=np.uint8)
    half = qs.shape[1]
    np.bitwise_and(qs, 0x0F, out=out[:, :half])
    np.right_shift(qs, 4, out=out[:, half:])
    return out


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Bit j of a little-endian bitfield as element j (0 or 1)."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(blocks[:, 2:].view(np.int8), _f16(blocks, 0), out=out)


def _q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    q = _nibbles(blocks[:, 2:]).view(np.int8)
    q -= 8
    np.multiply(q, _f16(blocks, 0), out=out)


def _q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_nibbles(blocks[:, 4:]), _f16(blocks, 0), out=out)
    out += _f16(blocks, 2)


def _q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    q = _nibbles(blocks[:, 6:])
    q |= _high_bits(blocks[:, 2:6]) << 4
    q = q.view(np.int8)
    q -= 16
    np.multiply(q, _f16(blocks, 0), out=out)


def _q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    q = _nibbles(blocks[:, 8:])
    q |= _high_bits(blocks[:, 4:8]) << 4
    np.multiply(q, _f16(blocks, 0), out=out)
    out += _f16(blocks, 2)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and eight 6-bit mins packed into 12 bytes (ggml get_scale_min_k4):
    sub-blocks 0-3 use the low 6 bits of bytes 0-3 / 4-7; sub-blocks 4-7 take their low 4 bits
    from bytes 8-11 and their top 2 bits from the spare top bits of bytes 0-3 / 4-7."""
    sc = np.empty((s.shape[0], 8), dtype=np.uint8)
    mn = np.empty((s.shape[0], 8), dtype=np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _k4_values(ql: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 4-bit values, ordered in 8 sub-blocks of 32: each 32-byte run gives
    one sub-block from its low nibbles and the next from its high nibbles."""
    n = ql.shape[0]
    q = np.empty((n, 4, 2, 32), dtype=np.uint8)
    runs = ql.reshape(n, 4, 32)
    np.bitwise_and(runs, 0x0F, out=q[:, :, 0])
    np.right_shift(runs, 4, out=q[:, :, 1])
    return q.reshape(n, 8, 32)


def _k_apply(q: np.ndarray, blocks: np.ndarray, sc: np.ndarray, mn: np.ndarray, out: np.ndarray) -> None:
    d = _f16(blocks, 0) * sc  # [n, 8] per-sub-block scale
    m = _f16(blocks, 2) * mn  # [n, 8] per-sub-block offset
    out3 = out.reshape(q.shape)
    np.multiply(q, d[:, :, None], out=out3)
    out3 -= m[:, :, None]


def _q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    sc, mn = _k4_scales(blocks[:, 4:16])
    _k_apply(_k4_values(blocks[:, 16:144]), blocks, sc, mn, out)


def _q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    sc, mn = _k4_scales(blocks[:, 4:16])
    q = _k4_values(blocks[:, 48:176])
    # qh byte l holds the fifth bit of element l of sub-block s in bit s.
    hb = np.unpackbits(blocks[:, 16:48].reshape(-1, 32, 1), axis=2, bitorder="little")  # [n, 32, 8]
    q |= hb.transpose(0, 2, 1) << 4
    _k_apply(q, blocks, sc, mn, out)


_Q6_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def _q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    # Two halves of 128 elements; in each, group g (32 elements) takes its low 4 bits from
    # ql[g % 2] (low nibble for g < 2, high for g >= 2) and its top 2 bits from qh >> 2g.
    ql = blocks[:, 0:128].reshape(n, 2, 2, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    q = np.empty((n, 2, 4, 32), dtype=np.uint8)
    np.bitwise_and(ql, 0x0F, out=q[:, :, 0:2])
    np.right_shift(ql, 4, out=q[:, :, 2:4])
    q |= ((qh >> _Q6_SHIFTS) & 3) << 4
    q = q.view(np.int8)
    q -= 32
    # 16 int8 scales, one per 16 elements, in element order.
    scale = blocks[:, 192:208].view(np.int8).astype(np.float32) * _f16(blocks, 208)
    np.multiply(q.reshape(n, 16, 16), scale[:, :, None], out=out.reshape(n, 16, 16))


def _bf16(blocks: np.ndarray, out: np.ndarray) -> None:
    # bfloat16 is the top half of a float32, so widening is exact.
    wide = blocks.view(np.uint16).astype(np.uint32)
    wide <<= 16
    out[...] = wide.view(np.float32)


# Our kernels, by type: each one is here because bench_dequant.py measured it faster than
# gguf's for its type (docs/benchmarks.md, "Kernels and weights on the CPU").
OWN_PATHS: dict[QType, Callable[[np.ndarray, np.ndarray], None]] = {
    QType.BF16: _bf16,
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q8_0: _q8_0,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
}


def random_k_blocks(qtype: QType, rows: int, cols: int, rng: np.random.Generator,
                    d_range: tuple[float, float] = (1e-6, 1e-2)) -> np.ndarray:
    """Random but valid Q4_K or Q6_K super-blocks for ``rows`` x ``cols`` weights, ``uint8 [rows, row_bytes]``.

    gguf-py cannot quantise the K types, so the kernels' tests and ``benchmarks/make_shaped_gguf.py`` write
    them this way: random quants and packed 6-bit (Q4_K) or int8 (Q6_K) scales, every float16 scale (``d``,
    Q4_K's ``dmin``) positive and log-uniform in ``d_range`` (subnormals included by the default), never NaN
    or Inf.
    """
    if qtype not in (QType.Q4_K, QType.Q6_K):
        raise ValueError(f"random_k_blocks writes Q4_K or Q6_K, not {qtype.name}")
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    if cols % block_elems:
        raise ValueError(f"{cols} columns is not a whole number of {qtype.name} super-blocks of {block_elems}")
    n = rows * (cols // block_elems)
    blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    low, high = np.log(d_range[0]), np.log(d_range[1])
    for offset in (0, 2) if qtype == QType.Q4_K else (208,):  # d and dmin (Q4_K), d (Q6_K: its last 2 bytes)
        d = np.exp(rng.uniform(low, high, size=(n, 1))).astype(np.float16)
        blocks[:, offset : offset + 2] = d.view(np.uint8)
    return blocks.reshape(rows, -1)


def ggml_type(type_id: int) -> QType:
    """The ``GGMLQuantizationType`` for a raw id, or ``UnsupportedQuantType`` naming it."""
    try:
        qtype = QType(int(type_id))
    except ValueError:
        raise UnsupportedQuantType(_unsupported(f"type id {int(type_id)}")) from None
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedQuantType(_unsupported(qtype.name))
    return qtype


def _unsupported(name: str) -> str:
    supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
    return f"ggml tensor type {name} is not supported (supported: {supported})"


def nbytes(qtype: QType, n_elements: int) -> int:
    """Bytes ``n_elements`` of ``qtype`` take; ``n_elements`` must be whole blocks."""
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    if n_elements % block_elems:
        raise ValueError(f"{n_elements} elements is not a whole number of {qtype.name} blocks of {block_elems}")
    return n_elements // block_elems * block_bytes


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...], *, keep_f16: bool = False) -> np.ndarray:
    """Decode the raw bytes of one tensor into a new float32 array of ``shape`` (numpy order).

    ``raw`` is any contiguous array holding exactly the tensor's bytes (a GGUF memmap slice).
    With ``keep_f16`` a float16 tensor comes back as float16, as stored.
    The result never aliases ``raw``.
    """
    qtype = ggml_type(qtype)
    n_elements = int(np.prod(shape, dtype=np.int64))
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    expected = nbytes(qtype, n_elements)
    if data.size != expected:
        raise ValueError(f"{qtype.name} tensor of shape {shape} needs {expected} bytes, got {data.size}")
    if qtype == QType.F16 and keep_f16:
        return data.view(np.float16).reshape(shape).copy()
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    kernel = OWN_PATHS.get(qtype)
    if kernel is None:
        if n_elements == 0:  # no rows to hand gguf
            return np.empty(shape, dtype=np.float32)
        # gguf works through a tensor in groups of rows, so it gets the tensor's rows.
        row_elems = shape[-1] if shape and shape[-1] % block_elems == 0 else n_elements
        rows = data.reshape(-1, row_elems // block_elems * block_bytes)
        values = np.asarray(gguf_dequantize(rows, qtype), dtype=np.float32)
        if np.may_share_memory(values, data):  # gguf hands F32 back as a view of its input
            values = values.copy()
        return values.reshape(shape)
    blocks = data.reshape(-1, block_bytes)
    out = np.empty((blocks.shape[0], block_elems), dtype=np.float32)
    step = max(1, _CHUNK_ELEMENTS // block_elems)
    for start in range(0, blocks.shape[0], step):
        kernel(blocks[start : start + step], out[start : start + step])
    return out.reshape(shape)
