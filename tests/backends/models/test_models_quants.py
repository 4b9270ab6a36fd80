"""``quants.dequantize`` (our kernels where they are faster, gguf's otherwise) against gguf-py's
own decoding, which serves as the oracle."""

from __future__ import annotations

import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from inferflux.backends.models import quants  # noqa: E402
from inferflux.backends.models.quants import UnsupportedQuantType  # noqa: E402

# Byte offsets of the float16 scales in each block type: random bytes there could be inf/nan,
# which would make the comparison meaningless, so they are overwritten with finite values.
_F16_FIELDS = {
    QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2),
    QType.Q8_0: (0,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,),
}


def _random_tensor(qtype: QType, rows: int, blocks_per_row: int, seed: int) -> tuple[np.ndarray, tuple[int, int]]:
    rng = np.random.default_rng(seed)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    shape = (rows, blocks_per_row * block_elems)
    if qtype == QType.F32:
        return rng.standard_normal(shape).astype(np.float32).view(np.uint8), shape
    if qtype == QType.F16:
        return rng.standard_normal(shape).astype(np.float16).view(np.uint8), shape
    raw = rng.integers(0, 256, size=(rows, blocks_per_row * block_bytes), dtype=np.uint8)
    if qtype == QType.BF16:
        # keep the exponent away from all-ones so every value is finite
        raw.reshape(-1, 2)[:, 1] &= 0x7E
        return raw, shape
    blocks = raw.reshape(-1, block_bytes)
    for offset in _F16_FIELDS[qtype]:
        scales = rng.uniform(-3, 3, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8)
    return raw, shape


def _oracle(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    if qtype == QType.F32:
        data = raw.view(np.float32)
    elif qtype == QType.F16:
        data = raw.view(np.float16)
    else:
        data = raw
    return np.asarray(gguf_dequantize(data, qtype), dtype=np.float32).reshape(shape)


@pytest.mark.parametrize("qtype", sorted(quants.SUPPORTED_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks_per_row", [(1, 1), (3, 5), (7, 40)])
def test_random_bytes_match_gguf(qtype, rows, blocks_per_row):
    raw, shape = _random_tensor(qtype, rows, blocks_per_row, seed=rows * 1000 + blocks_per_row)
    ours = quants.dequantize(raw, qtype, shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    assert np.all(np.isfinite(ours))
    np.testing.assert_array_equal(ours, _oracle(raw, qtype, shape))


def test_many_blocks_cross_chunk_boundaries(monkeypatch):
    # A small chunk size forces the chunked loop through several iterations and a ragged tail.
    monkeypatch.setattr(quants, "_CHUNK_ELEMENTS", 3 * 256)
    for qtype in (QType.Q4_1, QType.Q6_K):
        raw, shape = _random_tensor(qtype, 5, 7, seed=11)
        np.testing.assert_array_equal(quants.dequantize(raw, qtype, shape), _oracle(raw, qtype, shape))


def test_keep_f16_returns_stored_halves():
    raw, shape = _random_tensor(QType.F16, 2, 8, seed=3)
    out = quants.dequantize(raw, QType.F16, shape, keep_f16=True)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, raw.view(np.float16).reshape(shape))


def test_result_does_not_alias_input():
    raw, shape = _random_tensor(QType.F32, 2, 4, seed=5)
    out = quants.dequantize(raw, QType.F32, shape)
    out[...] = 0
    assert np.any(raw.view(np.float32) != 0)


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.Q4_1])
def test_empty_tensors_decode_to_empty_arrays(qtype):
    # gguf's path (F32, F16) and ours (Q4_1) alike.
    out = quants.dequantize(np.zeros(0, np.uint8), qtype, (0, 32))
    assert out.shape == (0, 32) and out.dtype == np.float32


def test_wrong_byte_count_is_rejected():
    raw, shape = _random_tensor(QType.Q8_0, 2, 2, seed=1)
    with pytest.raises(ValueError, match="needs 136 bytes, got 135"):
        quants.dequantize(raw.reshape(-1)[:-1], QType.Q8_0, shape)


def test_unsupported_type_is_named():
    with pytest.raises(UnsupportedQuantType, match="Q2_K"):
        quants.dequantize(np.zeros(84, np.uint8), 10, (256,))  # 10 = Q2_K


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight",
                                  "blk.3.attn_norm.weight"])
@pytest.mark.model
def test_default_model_tensors_match_gguf(default_model, name):
    t = default_model._tensors[name]
    shape = tuple(reversed([int(d) for d in t.shape]))
    np.testing.assert_array_equal(
        quants.dequantize(t.data, int(t.tensor_type), shape),
        np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape),
    )


@pytest.mark.model
def test_whole_default_model_dequantises_fast(default_model):
    # CPU time, not wall time, so a busy shared machine does not make this flaky; the bound
    # is loose but catches a fall back to per-block python (which takes minutes).
    start = time.process_time()
    total = 0
    for t in default_model._tensors.values():
        shape = tuple(reversed([int(d) for d in t.shape]))
        total += quants.dequantize(t.data, int(t.tensor_type), shape).size
    elapsed = time.process_time() - start
    assert total == 134_515_008
    assert elapsed < 4.0, f"dequantising the default model took {elapsed:.2f}s of CPU"
