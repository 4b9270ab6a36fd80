"""CUDA graphs of decode-only steps (``CUDABackend``'s): one graph per padded batch size.

A decode step of a few sequences is bound by launching its hundreds of small
kernels from Python; replayed as a captured graph it costs one launch. Batches are
padded to the next of ``GRAPH_BATCH_SIZES`` (``DecodeGraphs``'s docstring says
how padded rows stay harmless), so a handful of graphs serve every batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from inferflux.backends.base import Batch

if TYPE_CHECKING:
    import torch

    from inferflux.backends.cpu.model import AttentionMetadata, Transformer

# Decode batches are padded up to one of these sizes, each with its own graph.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def graph_batch_size(n: int, sizes: Sequence[int] = GRAPH_BATCH_SIZES) -> int | None:
    """The captured size a decode step of ``n`` sequences is padded to; None past the largest."""
    if n < 1:
        return None
    return next((size for size in sorted(sizes) if n <= size), None)


class DecodeGraphs:
    """CUDA graphs of decode-only steps, one per batch size, over static input buffers.

    A step of ``n`` sequences is copied into the first ``n`` rows of the buffers and
    padded to the next captured size; padded rows run token 0 at position 0 of
    ``scratch_block``, a KV block no sequence owns, so they write only there. The
    block-table buffer is ``width`` blocks wide for every size, the longest context
    a sequence can have, so one graph serves every context length (the kernels read
    a row's table only up to its context length).

    Before ``capture`` (or where it is impossible: no CUDA), ``run`` executes the
    same static forward eagerly; that is how the padding is tested without a GPU.
    """

    def __init__(
        self,
        model: Transformer,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        scratch_block: int,
        width: int,
        sizes: Sequence[int] = GRAPH_BATCH_SIZES,
    ) -> None:
        import torch

        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.scratch_block, self.width = block_size, scratch_block, width
        self.sizes = tuple(sorted(sizes))
        n = self.sizes[-1]
        device = kv_caches[0][0].device
        head_dim = kv_caches[0][0].shape[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.zeros(n, dtype=torch.long, device=device)
        self.cos = torch.ones((n, 1, head_dim), dtype=model.dtype, device=device)  # position 0: no rotation
        self.sin = torch.zeros_like(self.cos)
        self.tables = torch.full((n, width), scratch_block, dtype=torch.long, device=device)
        self.lens = torch.ones(n, dtype=torch.long, device=device)
        self.starts = torch.zeros(n, dtype=torch.long, device=device)
        self.rows = torch.arange(n, device=device)
        self._pad(0, n)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # size -> (torch.cuda.CUDAGraph, its logits)

    def size_for(self, batch: Batch) -> int | None:
        """The size to pad ``batch`` to, or None when it must run eagerly."""
        if any(len(s.token_ids) != 1 or s.num_logits != 1 for s in batch.slices):
            return None  # prefill chunks, drafts being verified
        if any(s.start_pos >= self.width * self.block_size for s in batch.slices):
            return None
        return graph_batch_size(len(batch.slices), self.sizes)

    def run(self, ids: torch.Tensor, meta: AttentionMetadata, size: int) -> torch.Tensor:
        """Logits ``[n, vocab]`` of a decode step prepared on the host (rows ``n..size`` are padding)."""
        n = ids.shape[0]
        self._load(ids, meta, size)
        if size not in self.graphs:
            return self._forward_static(size)[:n]
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]  # a view of the graph's output: the caller copies it before the next replay

    def capture(self) -> None:
        """Capture every size; raises whatever the capture raises (the caller then runs eagerly)."""
        import torch

        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # the largest first: the others reuse its memory pool
                self._pad(0, size)
                warmup = torch.cuda.Stream()
                warmup.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(warmup):  # compiles the Triton kernels outside the capture
                    self._forward_static(size)
                torch.cuda.current_stream().wait_stream(warmup)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward_static(size)
                pool = graph.pool()
                self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    def _load(self, ids: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        n, width = ids.shape[0], meta.decode_tables.shape[1]
        self.ids[:n].copy_(ids, non_blocking=True)
        self.slots[:n].copy_(meta.slots, non_blocking=True)
        self.cos[:n].copy_(meta.cos, non_blocking=True)
        self.sin[:n].copy_(meta.sin, non_blocking=True)
        # Columns past ``width`` keep earlier steps' block ids: valid blocks, never read.
        self.tables[:n, :width].copy_(meta.decode_tables, non_blocking=True)
        self.lens[:n].copy_(meta.decode_lens, non_blocking=True)
        self.starts[:n].copy_(meta.decode_starts, non_blocking=True)
        self._pad(n, size)

    def _pad(self, start: int, stop: int) -> None:
        # cos/sin of padded rows keep whatever finite values they hold: nothing reads those rows' results.
        self.ids[start:stop] = 0
        self.slots[start:stop] = self.scratch_block * self.block_size
        self.tables[start:stop, 0] = self.scratch_block
        self.lens[start:stop] = 1
        self.starts[start:stop] = 0

    def _forward_static(self, size: int) -> torch.Tensor:
        from inferflux.backends.cpu.model import AttentionMetadata

        meta = AttentionMetadata(
            slots=self.slots[:size], cos=self.cos[:size], sin=self.sin[:size],
            decode_rows=slice(0, size), decode_tables=self.tables[:size],
            decode_lens=self.lens[:size], decode_starts=self.starts[:size],
            decode_mask=None, prefills=[],
        )
        return self.model(self.ids[:size], meta, self.kv_caches, self.rows[:size])
