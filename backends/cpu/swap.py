"""Swap space for preempted sequences' KV blocks: in host memory, or in a file on disk.

A slot holds one KV block across all layers as raw bytes. ``gather_blocks`` and
``scatter_blocks`` move blocks between the paged caches and that flat form.

For the CPU backend the disk tier is the useful one (host memory *is* its KV
memory); ``DiskSwap`` keeps writes off the engine's step loop: ``write`` copies
the blocks' bytes into memory and returns, a writer thread puts them in the
file, and ``read`` serves a slot from memory while its write is still under way.
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
from typing import Sequence

import numpy as np
import torch

from inferflux.backends.base import BackendError

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]

# Bytes parked in memory waiting for the disk before ``write`` waits for the
# writer: a bound on what a slow disk can make the process hold.
MAX_PENDING_BYTES = 256 << 20


def stack_blocks(kv_caches: KVCaches, blocks: Sequence[int]) -> torch.Tensor:
    """``[len(blocks), 2 * layers, kv_heads, block_size, head_dim]``, on the caches'
    device: each block's K then V of layer 0, then of layer 1, ..."""
    index = torch.tensor(blocks, dtype=torch.long, device=kv_caches[0][0].device)
    # [2 * layers, kv_heads, n, block_size, head_dim] -> block-major
    parts = torch.stack([c.index_select(1, index) for layer in kv_caches for c in layer])
    return parts.permute(2, 0, 1, 3, 4).contiguous()


def unstack_blocks(kv_caches: KVCaches, blocks: Sequence[int], parts: torch.Tensor) -> None:
    """Write ``stack_blocks``' output (on the caches' device) back into ``blocks``."""
    index = torch.tensor(blocks, dtype=torch.long, device=kv_caches[0][0].device)
    for i, (k_cache, v_cache) in enumerate(kv_caches):
        k_cache.index_copy_(1, index, parts[:, 2 * i].transpose(0, 1))
        v_cache.index_copy_(1, index, parts[:, 2 * i + 1].transpose(0, 1))


def gather_blocks(kv_caches: KVCaches, blocks: Sequence[int]) -> np.ndarray:
    """``[len(blocks), slot_bytes]`` uint8: ``stack_blocks`` as raw bytes on the host."""
    return stack_blocks(kv_caches, blocks).view(torch.uint8).reshape(len(blocks), -1).cpu().numpy()


def scatter_blocks(kv_caches: KVCaches, blocks: Sequence[int], data: np.ndarray) -> None:
    """Write ``gather_blocks``' output back into ``blocks``."""
    k0 = kv_caches[0][0]
    kv_heads, _, block_size, head_dim = k0.shape
    raw = torch.from_numpy(np.ascontiguousarray(data)).to(k0.device)
    parts = raw.view(k0.dtype).view(len(blocks), 2 * len(kv_caches), kv_heads, block_size, head_dim)
    unstack_blocks(kv_caches, blocks, parts)


class HostSwap:
    """Slots in one host-memory array."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.store = np.zeros((num_slots, slot_bytes), dtype=np.uint8)

    def write(self, slots: Sequence[int], data: np.ndarray) -> None:
        self.store[list(slots)] = data

    def read(self, slots: Sequence[int]) -> np.ndarray:
        return self.store[list(slots)]

    def close(self) -> None:
        pass


class DiskSwap:
    """Slots in one file under ``directory``, written by a background thread."""

    def __init__(self, num_slots: int, slot_bytes: int, directory: str) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        try:
            os.makedirs(directory, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="inferflux-kv-", suffix=".swap", dir=directory)
        except OSError as exc:
            raise BackendError(f"cannot create a swap file in {directory!r}: {exc}") from exc
        # Unlinked at once: the space goes back to the file system whenever the
        # process ends, a crash included. The file is sparse until written.
        os.unlink(path)
        self._fd = fd
        os.ftruncate(fd, num_slots * slot_bytes)
        self._cond = threading.Condition()
        self._pending: dict[int, np.ndarray] = {}  # slot -> newest bytes not yet on disk
        self._pending_bytes = 0
        self._error: OSError | None = None
        self._queue: queue.SimpleQueue[tuple[int, np.ndarray] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="inferflux-kv-swap", daemon=True)
        self._writer.start()

    def write(self, slots: Sequence[int], data: np.ndarray) -> None:
        rows = [np.array(row, copy=True) for row in data]  # the caller's buffer is not ours to keep
        with self._cond:
            self._raise_error()
            while self._pending_bytes > MAX_PENDING_BYTES:
                self._cond.wait()
                self._raise_error()
            for slot, row in zip(slots, rows):
                self._check(slot)
                old = self._pending.get(slot)
                self._pending_bytes += row.nbytes - (0 if old is None else old.nbytes)
                self._pending[slot] = row
                self._queue.put((slot, row))

    def read(self, slots: Sequence[int]) -> np.ndarray:
        out = np.empty((len(slots), self.slot_bytes), dtype=np.uint8)
        for i, slot in enumerate(slots):
            self._check(slot)
            with self._cond:
                self._raise_error()
                row = self._pending.get(slot)
                if row is not None:
                    out[i] = row
                    continue
            got = os.preadv(self._fd, [out[i]], slot * self.slot_bytes)
            if got != self.slot_bytes:
                raise BackendError(f"swap file: short read of slot {slot} ({got} of {self.slot_bytes} bytes)")
        return out

    def flush(self) -> None:
        """Wait until every write so far is on disk (tests; shutdown)."""
        with self._cond:
            while self._pending and self._error is None:
                self._cond.wait()
            self._raise_error()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join()
        os.close(self._fd)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            slot, row = item
            try:
                os.pwrite(self._fd, row, slot * self.slot_bytes)
            except OSError as exc:  # surfaced to the engine by the next write or read
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                continue
            with self._cond:
                if self._pending.get(slot) is row:  # not superseded by a newer write of the slot
                    del self._pending[slot]
                    self._pending_bytes -= row.nbytes
                self._cond.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise BackendError(f"swap file write failed: {self._error}")

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise BackendError(f"swap slot {slot} out of range 0..{self.num_slots - 1}")
