"""Swap slots in host memory for a KV cache on a device, filled without stalling the step loop on CUDA.

``DeviceRunner`` preempts by swap into a ``DeviceSwap`` when swap space lives in
memory (a ``directory`` gets ``CPUBackend``'s swap file instead); ``DeviceSwap``'s
docstring says how a copy overlaps the next steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from inferflux.backends.base import BackendError

if TYPE_CHECKING:
    import torch


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first index, count, first slot)`` per run of consecutive slots: one copy per run, not per block."""
    runs: list[list[int]] = []
    for i, slot in enumerate(slots):
        if runs and slot == runs[-1][2] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([i, 1, slot])
    return [(first, count, slot) for first, count, slot in runs]


class DeviceSwap:
    """Swap slots in host memory for a KV cache on a device.

    A slot holds one block of every layer, ``[2 * layers, kv_heads, block_size,
    head_dim]`` (K then V of layer 0, then of layer 1, ...).

    On CUDA the slots are pinned and ``swap_out`` does not wait for the host copy.
    It first gathers the blocks into a staging tensor on the device, on the
    compute stream: a device-to-device copy at memory speed, and every later use of
    the blocks (a forward, ``copy_blocks``, ``swap_in``) is queued after it on that
    same stream, so the blocks may be overwritten as soon as ``swap_out`` returns.
    A side stream then copies staging to the slots over PCIe, overlapping the next
    steps, and records an event that ``swap_in`` of those slots makes the compute
    stream wait for. The alternative, a synchronous copy into pinned memory, would
    stall the step loop for the whole PCIe transfer. ``record_stream`` keeps the
    staging memory from being reused until the side stream is done with it.
    Elsewhere (cpu, mps) the copies are plain synchronous ones.
    """

    def __init__(self, num_slots: int, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        import torch

        k0 = kv_caches[0][0]
        kv_heads, _, block_size, head_dim = k0.shape
        self.device = k0.device
        self.num_slots = num_slots
        self.slot_shape = (2 * len(kv_caches), kv_heads, block_size, head_dim)
        cuda = self.device.type == "cuda"
        try:
            self.store = torch.empty((num_slots, *self.slot_shape), dtype=k0.dtype, pin_memory=cuda)
        except RuntimeError as exc:
            raise BackendError(f"cannot allocate {num_slots} swap slots in host memory: {exc}") from exc
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.pending: dict[int, Any] = {}  # slot -> torch.cuda.Event of the copy that fills it

    def swap_out(
        self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], pairs: Sequence[tuple[int, int]]
    ) -> None:
        import torch

        if not pairs:
            return
        from inferflux.backends.cpu.swap import stack_blocks

        slots = self._checked([slot for _, slot in pairs])
        staging = stack_blocks(kv_caches, [block for block, _ in pairs])
        if self.stream is None:
            self._copy_runs(slots, staging, to_host=True)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._copy_runs(slots, staging, to_host=True)
            done = torch.cuda.Event()
            done.record()
        staging.record_stream(self.stream)
        for slot in slots:
            self.pending[slot] = done

    def swap_in(
        self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], pairs: Sequence[tuple[int, int]]
    ) -> None:
        import torch

        if not pairs:
            return
        slots = self._checked([slot for slot, _ in pairs])
        if self.stream is not None:
            compute = torch.cuda.current_stream(self.device)
            for event in {id(e): e for s in slots if (e := self.pending.pop(s, None)) is not None}.values():
                compute.wait_event(event)  # the device waits, not the host
        from inferflux.backends.cpu.swap import unstack_blocks

        staging = torch.empty((len(slots), *self.slot_shape), dtype=self.store.dtype, device=self.device)
        self._copy_runs(slots, staging, to_host=False)
        unstack_blocks(kv_caches, [block for _, block in pairs], staging)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self.pending.clear()

    def _copy_runs(self, slots: Sequence[int], staging: torch.Tensor, to_host: bool) -> None:
        for first, count, slot in slot_runs(slots):
            host, dev = self.store[slot : slot + count], staging[first : first + count]
            dst, src = (host, dev) if to_host else (dev, host)
            dst.copy_(src, non_blocking=self.stream is not None)

    def _checked(self, slots: list[int]) -> list[int]:
        bad = [s for s in slots if not 0 <= s < self.num_slots]
        if bad:
            raise BackendError(f"swap slots {bad} out of range 0..{self.num_slots - 1}")
        return slots
