"""The CPU backend's swap space: blocks survive the round trip through host memory and disk."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from inferflux.backends.base import BackendError
from inferflux.backends.cpu.swap import DiskSwap, HostSwap, gather_blocks, scatter_blocks


def random_caches(dtype: torch.dtype, layers: int = 3, kv_heads: int = 2, blocks: int = 6, bs: int = 4, hd: int = 8):
    g = torch.Generator().manual_seed(0)
    shape = (kv_heads, blocks, bs, hd)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_blocks_scatter_back_bit_for_bit(dtype) -> None:
    caches = random_caches(dtype)
    before = [(k.clone(), v.clone()) for k, v in caches]
    data = gather_blocks(caches, [4, 1])
    elem = torch.finfo(dtype).bits // 8
    assert data.shape == (2, 2 * 3 * 2 * 4 * 8 * elem) and data.dtype == np.uint8
    scatter_blocks(caches, [0, 5], data)  # block 4 -> 0, block 1 -> 5
    for (k, v), (k0, v0) in zip(caches, before):
        assert torch.equal(k[:, 0], k0[:, 4]) and torch.equal(v[:, 0], v0[:, 4])
        assert torch.equal(k[:, 5], k0[:, 1]) and torch.equal(v[:, 5], v0[:, 1])
        assert torch.equal(k[:, 1:5], k0[:, 1:5])  # nothing else moved


def _rows(n: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, width), dtype=np.uint8)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_slots_read_back_what_was_written(tier, tmp_path) -> None:
    swap = HostSwap(5, 64) if tier == "host" else DiskSwap(5, 64, str(tmp_path))
    first = _rows(3, 64, 1)
    swap.write([4, 0, 2], first)
    np.testing.assert_array_equal(swap.read([2, 4]), first[[2, 0]])
    newer = _rows(1, 64, 2)
    swap.write([0], newer)  # a slot given back and reused
    if isinstance(swap, DiskSwap):
        swap.flush()  # now from the file, not from memory
    np.testing.assert_array_equal(swap.read([0, 4, 2]), np.concatenate([newer, first[[0, 2]]]))
    swap.close()


def test_the_disk_tier_keeps_nothing_in_memory_once_written_and_leaves_no_file(tmp_path) -> None:
    swap = DiskSwap(64, 4096, str(tmp_path / "kv"))
    assert os.listdir(tmp_path / "kv") == []  # unlinked at once: a crash leaves nothing behind
    data = _rows(64, 4096, 3)
    for i in range(0, 64, 8):
        swap.write(list(range(i, i + 8)), data[i : i + 8])
    swap.flush()
    assert swap._pending == {} and swap._pending_bytes == 0
    np.testing.assert_array_equal(swap.read(list(range(64))), data)
    swap.close()


def test_swap_errors_are_backend_errors(tmp_path) -> None:
    swap = DiskSwap(2, 8, str(tmp_path))
    with pytest.raises(BackendError, match="out of range"):
        swap.write([2], _rows(1, 8, 0))
    with pytest.raises(BackendError, match="out of range"):
        swap.read([-1])
    swap.close()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(BackendError, match="cannot create a swap file"):
        DiskSwap(2, 8, str(blocker))
