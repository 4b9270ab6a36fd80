"""Constants and helpers shared by the conformance tests and their conftest.
(Named uniquely: tests/ has no __init__.py files.)"""

from __future__ import annotations

from typing import Any

import numpy as np

from inferflux.backends.base import Batch, SequenceSlice

BLOCK = 16
MAX_TOKENS = 16  # greedy tokens per reference prompt: every prompt crosses a block boundary while decoding


def greedy_direct(backend: Any, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens for one sequence: a full prefill, then single-token steps."""
    table = list(range(blocks_for(len(ids) + n)))
    backend.allocate_kv(len(table), BLOCK)
    out: list[int] = []
    logits = backend.forward(Batch([SequenceSlice(0, ids, 0, table, 1)], BLOCK))
    for i in range(n):
        out.append(int(np.asarray(logits)[0].argmax()))
        if i + 1 < n:
            logits = backend.forward(Batch([SequenceSlice(0, out[-1:], len(ids) + i, table, 1)], BLOCK))
    return out


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK)
