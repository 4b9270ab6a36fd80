"""The engine's ``Batch`` as the tensors one forward takes: token ids, cache slots, RoPE rows, attention groups.

``CPUBackend._prepare`` flattens every step's batch here, on the host, and
``DeviceRunner`` moves the result to its device. Single-token rows (decode steps)
are one group, with their block tables padded to one width; every other
sequence's run of new tokens is a ``PrefillGroup`` of its own: fresh from
position 0 (attending over its own new K/V) or continuing one whose earlier
positions are in the cache. ``fresh_inputs`` is the same for embedding inputs,
which run as fresh sequences and write no KV.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from inferflux.backends.base import Batch
from inferflux.backends.cpu.model import CONTINUATION_KERNEL_WORK, AttentionMetadata, PrefillGroup
from inferflux.kernels.reference import attention_mask

# The RoPE cos and sin rows of the positions (all below the int): CPUBackend._rope.
Rope = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


StepInputs = tuple[torch.Tensor, AttentionMetadata, torch.Tensor]  # token ids, metadata, the rows whose logits return


def step_inputs(batch: Batch, rope: Rope, mask_group: int | None) -> StepInputs:
    """Token ids, attention metadata and the batch rows whose logits are returned.

    ``mask_group``: query heads per KV head where the reference kernels take the decode
    rows (their mask is built here, once a step, for every layer); None for kernels that
    mask by themselves.
    """
    bs = batch.block_size
    ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    logits_rows: list[int] = []
    decode_rows: list[int] = []
    decode_tables: list[np.ndarray] = []
    decode_lens: list[int] = []
    prefills: list[PrefillGroup] = []
    for s in batch.slices:
        n = len(s.token_ids)
        start = len(ids)
        table = np.asarray(s.block_table, dtype=np.int64)
        new_pos = np.arange(s.start_pos, s.start_pos + n, dtype=np.int64)  # this step's tokens only
        ids.extend(s.token_ids)
        positions.append(new_pos)
        slots.append(table[new_pos // bs] * bs + new_pos % bs)
        logits_rows.extend(range(start + n - s.num_logits, start + n))
        used_blocks = table[: (s.start_pos + n + bs - 1) // bs]
        if n == 1:
            decode_rows.append(start)
            decode_tables.append(used_blocks)
            decode_lens.append(s.start_pos + 1)
        else:
            prefills.append(_prefill_group(start, n, s.start_pos, used_blocks))
    pos = torch.from_numpy(np.concatenate(positions))
    cos, sin = rope(pos, max(s.start_pos + len(s.token_ids) for s in batch.slices))
    decode_index, decode_table, decode_len, decode_start, decode_mask = _decode_group(
        decode_rows, decode_tables, decode_lens, len(ids), bs, mask_group)
    meta = AttentionMetadata(
        slots=torch.from_numpy(np.concatenate(slots)),
        cos=cos,
        sin=sin,
        decode_rows=decode_index,
        decode_tables=decode_table,
        decode_lens=decode_len,
        decode_starts=decode_start,
        decode_mask=decode_mask,
        prefills=prefills,
    )
    return torch.tensor(ids, dtype=torch.long), meta, torch.tensor(logits_rows, dtype=torch.long)


def _prefill_group(start: int, n: int, start_pos: int, used_blocks: np.ndarray) -> PrefillGroup:
    """The ``n`` new tokens at batch row ``start``, from position ``start_pos`` of their sequence."""
    if start_pos == 0:
        return PrefillGroup(start, start + n, True, None, None, None)
    return PrefillGroup(
        start, start + n, False,
        torch.from_numpy(used_blocks)[None],
        torch.tensor([start_pos + n]),
        torch.tensor([start_pos]),
        short=n * (start_pos + n) <= CONTINUATION_KERNEL_WORK,
    )  # fmt: skip


DecodeFields = tuple[slice | torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def _decode_group(rows: list[int], tables: list[np.ndarray], lens: list[int], num_rows: int, block_size: int,
                  mask_group: int | None) -> DecodeFields | tuple[None, None, None, None, None]:  # fmt: skip
    """``AttentionMetadata``'s decode fields: the single-token rows, their tables padded to the
    longest, their context lengths and positions, and the reference's mask; all None without any."""
    if not rows:
        return None, None, None, None, None
    padded = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for row, t in zip(padded, tables):
        row[: len(t)] = t
    index = slice(0, num_rows) if len(rows) == num_rows else torch.tensor(rows)
    decode_len = torch.tensor(lens)
    decode_start = decode_len - 1
    mask = None
    if mask_group is not None:
        mask = attention_mask(decode_len, decode_start, 1, padded.shape[1] * block_size, mask_group)
    return index, torch.from_numpy(padded), decode_len, decode_start, mask


def fresh_inputs(token_lists: Sequence[Sequence[int]], rope: Rope) -> tuple[torch.Tensor, AttentionMetadata]:
    """Token ids and attention metadata of sequences that each start at position 0 and keep no KV."""
    ids: list[int] = []
    prefills: list[PrefillGroup] = []
    for tokens in token_lists:
        start = len(ids)
        ids.extend(tokens)
        prefills.append(PrefillGroup(start, len(ids), True, None, None, None))
    pos = torch.cat([torch.arange(len(tokens)) for tokens in token_lists])
    cos, sin = rope(pos, max(map(len, token_lists), default=0))
    meta = AttentionMetadata(
        slots=torch.empty(0, dtype=torch.long), cos=cos, sin=sin, decode_rows=None, decode_tables=None,
        decode_lens=None, decode_starts=None, decode_mask=None, prefills=prefills,
    )
    return torch.tensor(ids, dtype=torch.long), meta
