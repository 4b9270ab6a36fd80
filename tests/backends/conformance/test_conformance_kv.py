"""Every backend's paged KV cache, driven directly through the seam (backends/base.py):
multi-token forwards after cached context (speculative verification), copy_blocks,
and, where the backend has it, swap_out / swap_in.

Each test compares the backend with itself along two routes that must agree
(k tokens in one forward vs one at a time; a block read where it was written vs
where it was copied or swapped to), so a wrong slot, a stale block or a
misplaced causal mask shows up as different logits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conformance_kit import BLOCK, blocks_for

from inferflux.backends.base import Batch, SequenceSlice

# Context for the multi-token tests: 32 tokens with k = 4, or 272 with k = 8, which
# takes another attention path on the cpu backend (gather + matmul instead of its
# C++ kernel, as k x context > 2048).
TEXT = (
    "The bakery opens at seven on weekdays and at eight on Saturdays; it is closed on Sundays and public "
    "holidays. Bread is baked twice a day, croissants once, and the last tray leaves the oven at noon. "
) * 8
# Float32, but the two routes may sum in another order (and take other kernels).
MULTI_TOKEN_ATOL = 2e-4


def _forward(backend: Any, *slices: SequenceSlice) -> np.ndarray:
    return np.asarray(backend.forward(Batch(list(slices), BLOCK)), dtype=np.float32)


@pytest.mark.parametrize("context_len,k", [(32, 4), (272, 8)], ids=["context32-k4", "context272-k8"])
def test_multi_token_forward_equals_single_token_steps(backend_name, loaded, tokenizer, prompts, context_len, k):
    """Speculative verification: k new tokens after cached context in one forward, with
    a logits row each, give the logits of k single-token steps (tolerance MULTI_TOKEN_ATOL),
    also when another sequence's decode step shares the batch.

    The context fills whole blocks, prefilled once and shared by both routes (as the
    prefix cache shares them); each route writes its new tokens into a block of its own.
    """
    backend, _ = loaded
    ids = tokenizer.encode(TEXT)[: context_len + k]
    assert len(ids) == context_len + k and context_len % BLOCK == 0
    context, new = ids[:context_len], ids[context_len:]
    other = prompts[3]
    shared = list(range(context_len // BLOCK))
    multi, single = shared + [len(shared)], shared + [len(shared) + 1]
    neighbour = list(range(len(shared) + 2, len(shared) + 2 + blocks_for(len(other) + 1)))
    backend.allocate_kv(neighbour[-1] + 1, BLOCK)
    _forward(backend, SequenceSlice(0, context, 0, shared, 1), SequenceSlice(2, other, 0, neighbour, 1))

    verify = _forward(backend, SequenceSlice(0, new, context_len, multi, k),
                      SequenceSlice(2, [other[-1]], len(other), neighbour, 1))
    assert verify.shape[0] == k + 1
    steps = np.concatenate(
        [_forward(backend, SequenceSlice(1, [t], context_len + i, single, 1)) for i, t in enumerate(new)]
    )
    np.testing.assert_array_equal(verify[:k].argmax(axis=1), steps.argmax(axis=1))
    np.testing.assert_allclose(verify[:k], steps, atol=MULTI_TOKEN_ATOL, rtol=0)


def _filler(ids: list[int], n: int) -> list[int]:
    """``n`` tokens of another text, to overwrite blocks with KV that must not be read."""
    return (ids * (n // len(ids) + 1))[:n]


def _next_logits(backend: Any, ids: list[int], table: list[int], token: int) -> np.ndarray:
    """The decode step after ``ids`` whose KV is in ``table``."""
    return _forward(backend, SequenceSlice(9, [token], len(ids), table, 1))[0]


def test_copy_blocks(backend_name, loaded, prompts):
    """Blocks copied over blocks holding another sequence's KV serve the copied sequence,
    and the source blocks are left as they were."""
    backend, _ = loaded
    ids = prompts[1]
    filler = _filler(prompts[0], len(ids))
    n = blocks_for(len(ids) + 1)
    src, dst, fresh = list(range(n)), list(range(n, 2 * n)), list(range(2 * n, 3 * n))
    backend.allocate_kv(3 * n, BLOCK)
    _forward(backend, SequenceSlice(0, ids, 0, src, 1), SequenceSlice(1, filler, 0, dst, 1))
    backend.copy_blocks(list(zip(src, dst)))
    token = 42
    from_copy = _next_logits(backend, ids, dst, token)
    from_source = _next_logits(backend, ids, src, token)
    np.testing.assert_allclose(from_copy, from_source, atol=1e-5, rtol=0)
    # What the source should hold: the same decode after a fresh prefill elsewhere. That
    # prefill runs alone, the source's ran batched with the filler: other matmul shapes, so
    # float32 rounding may differ (seen: 4e-5 on logits of ~14 with AVX-512 kernels).
    _forward(backend, SequenceSlice(0, ids, 0, fresh, 1))
    np.testing.assert_allclose(_next_logits(backend, ids, fresh, token), from_source, atol=MULTI_TOKEN_ATOL, rtol=0)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_swap_round_trip(backend_name, loaded, prompts, tmp_path, tier):
    """swap_out, overwrite the blocks, swap_in (to other blocks and back to the same ones):
    the sequence decodes exactly as before."""
    backend, _ = loaded
    if not hasattr(backend, "allocate_swap"):
        pytest.skip(f"the {backend_name} backend has no allocate_swap (the optional swap seam in backends/base.py)")
    ids = prompts[1]
    filler = _filler(prompts[0], len(ids))
    n = blocks_for(len(ids) + 1)
    blocks, elsewhere = list(range(n)), list(range(n, 2 * n))
    slots = [3 + i for i in range(n)]  # not 0..n-1, so a backend that ignores the slot ids is caught
    backend.allocate_kv(2 * n, BLOCK)
    backend.allocate_swap(n + 3, BLOCK, None if tier == "host" else str(tmp_path))
    token = 42

    _forward(backend, SequenceSlice(0, ids, 0, blocks, 1))
    before = _next_logits(backend, ids, blocks, token)
    backend.swap_out(list(zip(blocks, slots)))
    _forward(backend, SequenceSlice(1, filler, 0, blocks, 1))  # the blocks now hold another sequence's KV
    backend.swap_in(list(zip(slots, elsewhere)))
    np.testing.assert_allclose(_next_logits(backend, ids, elsewhere, token), before, atol=1e-5, rtol=0)
    backend.swap_in(list(zip(slots, blocks)))
    np.testing.assert_allclose(_next_logits(backend, ids, blocks, token), before, atol=1e-5, rtol=0)
