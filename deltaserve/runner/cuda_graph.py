"""CUDA graphs for decode steps: the whole model (embedding to logits) captured once per batch size.

A decode step is launch-bound (hundreds of small kernels for a few milliseconds of weight traffic), so each
captured size replays as one launch. Inputs live in static buffers; a batch is padded to the next captured
size with rows that write only to a scratch state slot and a scratch page, which the cache manager never
hands out. The block-table width is part of the shape: graph_width() makes it the model's whole length where
the table stays small (MLA decode on the GPU reads only each sequence's context, whatever the width); decodes past
it, prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import torch

from deltaserve.runner.forward_batch import ForwardBatch

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MAX_TABLE_BYTES = 256 << 20  # the static block table: 134 MB for 256 requests of 1M tokens in pages of 16


def graph_width(max_model_len: int, block_size: int, max_batch: int) -> int:
    """Block-table width (pages) of the captured graphs: the whole model length, unless the table would take more
    than MAX_TABLE_BYTES; then as wide as fits (never under 4k tokens' worth)."""
    full = -(-max_model_len // block_size)
    fits = MAX_TABLE_BYTES // (8 * max_batch)
    return max(min(full, fits), min(full, -(-4096 // block_size)))


class DecodeGraphs:
    def __init__(self, model, caches, max_batch: int, max_blocks: int, block_size: int, scratch_slot: int,
                 scratch_block: int, device: torch.device):
        self.model, self.caches, self.max_blocks, self.block_size = model, caches, max_blocks, block_size
        self.sizes = [b for b in BATCH_SIZES if b < max_batch] + [max_batch]
        n = self.sizes[-1]
        new = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.positions, self.slot_mapping = new(n), new(n), new(n)
        self.state_slots, self.context_lens, self.block_tables = new(n), new(n), new(n, max_blocks)
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool."""
        from deltaserve.kernels.quant.experts import decode_graph_capture

        self._pad_from(0)
        with decode_graph_capture():
            self._capture_all()

    def _capture_all(self) -> None:
        for size in reversed(self.sizes):
            batch = self._batch(size)
            for _ in range(2):  # warm up: Triton autotuning and lazy init stay out of the graph
                self._forward(size, batch)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[size] = self._forward(size, batch)
            self.pool = graph.pool()
            self.graphs[size] = graph

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.num_decodes == batch.num_seqs <= self.sizes[-1]
                and batch.block_tables.shape[1] <= self.max_blocks)

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Replay for a decode-only batch; returns logits [B, V] float32 (a view of a static buffer)."""
        B, width = batch.num_seqs, batch.block_tables.shape[1]
        size = next(s for s in self.sizes if s >= B)
        self.input_ids[:B].copy_(input_ids)
        self.positions[:B].copy_(batch.positions)
        self.slot_mapping[:B].copy_(batch.slot_mapping)
        self.state_slots[:B].copy_(batch.state_slots)
        self.context_lens[:B].copy_(batch.context_lens)
        self.block_tables[:B, :width].copy_(batch.block_tables)  # entries past a context are never read
        self._pad_from(B)
        self.graphs[size].replay()
        return self.logits[size][:B]

    def _pad_from(self, start: int) -> None:
        """Rows from `start` on: one token into the scratch page, state in the scratch slot. Their context is that
        one token, so only the first table entry is read (a row is as wide as the model length: 512 KB at 1M)."""
        self.input_ids[start:].zero_()
        self.positions[start:].zero_()
        self.slot_mapping[start:].fill_(self.scratch_block * self.block_size)
        self.state_slots[start:].fill_(self.scratch_slot)
        self.context_lens[start:].fill_(1)
        self.block_tables[start:, 0].fill_(self.scratch_block)

    def _batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            state_slots=self.state_slots[:size], block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size], num_decodes=size, query_lens=[1] * size,
            start_positions=[0] * size, state_slot_list=[self.scratch_slot] * size)

    def _forward(self, size: int, batch: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(self.input_ids[:size], batch, self.caches))
