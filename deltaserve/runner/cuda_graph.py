"""CUDA graphs for decode steps: the whole model (embedding to logits) captured once per batch size.

A decode step is launch-bound (hundreds of small kernels for a few milliseconds of weight traffic), so each
captured size replays as one launch. Inputs live in static buffers; a batch is padded to the next captured
size with rows that write only to a scratch state slot and a scratch page, which the cache manager never
hands out. The block-table width is part of the shape: graph_width() makes it the model's whole length where
the table stays small (MLA decode on the GPU reads only each sequence's context, whatever the width); decodes past
it, prefill and mixed steps run eagerly."""

from __future__ import annotations

import logging
import time

import torch

from deltaserve.forward_batch import ForwardBatch
from deltaserve.runner.host_batch import HostBatch
from deltaserve.runner.startup import phase_bar

log = logging.getLogger("deltaserve")

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MAX_TABLE_BYTES = 256 << 20  # the static block table: 134 MB for 256 requests of 1M tokens in pages of 16


def graph_width(max_model_len: int, block_size: int, max_batch: int) -> int:
    """Block-table width (pages) of the captured graphs: the whole model length, unless the table would take more
    than MAX_TABLE_BYTES; then as wide as fits (never under 4k tokens' worth)."""
    full = -(-max_model_len // block_size)
    fits = MAX_TABLE_BYTES // (8 * max_batch)
    return max(min(full, fits), min(full, -(-4096 // block_size)))


class DecodeGraphs:
    # rows of the static input block: token id, position, MLA cache slot, KDA state slot, context length
    FIELDS = ("input_ids", "positions", "slot_mapping", "state_slots", "context_lens")

    def __init__(self, model, caches, max_batch: int, max_blocks: int, block_size: int, scratch_slot: int,
                 scratch_block: int, device: torch.device, num_stages: int = 1):
        self.model, self.caches, self.max_blocks, self.block_size = model, caches, max_blocks, block_size
        self.sizes = [b for b in BATCH_SIZES if b < max_batch] + [max_batch]
        n = self.sizes[-1]
        # a step's inputs reach the graph as one copy of this block (a padding row's values in every column past
        # the batch), staged in pinned host memory; plus one copy of the batch's block tables. num_stages staging
        # blocks: the lookahead steps of a step are queued without a sync, so each needs its own; and two sets of
        # them (sides): a step is queued before the step before it has synced (asynchronous scheduling)
        self.inputs = torch.zeros(len(self.FIELDS), n, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.state_slots, self.context_lens = self.inputs.unbind(0)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self.staging = torch.zeros(2, num_stages, len(self.FIELDS), n, dtype=torch.int64, pin_memory=pin)
        self.table_staging = [torch.zeros(0, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        # a padding row: one token into the scratch page, state in the scratch slot, a context of that one token,
        # so only its first table entry is read (whatever page that names: any page id in the table is valid, and
        # the row's output is dropped)
        self.padding = torch.tensor([0, 0, scratch_block * block_size, scratch_slot, 1], dtype=torch.int64)
        self.staging[:] = self.padding[:, None]
        self.block_tables[:, 0] = scratch_block
        self.inputs.copy_(self.staging[0, 0])
        self.staged = [[0] * num_stages for _ in range(2)]  # per staging block, its columns from here on: padding
        self.scratch_slot = scratch_slot
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool; log the seconds of the warm-up runs (where
        kernels compile and tune) and of the captures."""
        warm_up, capture = self._capture_all()
        sizes = ",".join(map(str, self.sizes))
        log.info("start-up: compile and tune %.2f s, in the warm-up runs of batch sizes %s", warm_up, sizes)
        log.info("start-up: graph capture %.2f s, %d graphs", capture, len(self.sizes))

    def _capture_all(self) -> tuple[float, float]:
        warm_up = capture = 0.0
        for size in phase_bar(list(reversed(self.sizes)), "capturing CUDA graphs", unit="graph"):
            batch = self._batch(size)
            start = time.perf_counter()
            for _ in range(2):  # warm up: Triton autotuning and lazy init stay out of the graph
                self._forward(size, batch)
            torch.cuda.synchronize(self.inputs.device)
            warmed = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[size] = self._forward(size, batch)
            self.pool = graph.pool()
            self.graphs[size] = graph
            warm_up, capture = warm_up + warmed - start, capture + time.perf_counter() - warmed
        return warm_up, capture

    def can_run(self, host: HostBatch) -> bool:
        return (all(n == 1 for n in host.query_lens) and host.num_seqs <= self.sizes[-1]
                and host.table_width <= self.max_blocks)

    def run(self, host: HostBatch, input_ids: torch.Tensor | None = None, stage: int = 0, side: int = 0
            ) -> torch.Tensor:
        """Replay for a decode-only batch; returns logits [B, V] float32 (a view of a static buffer).

        input_ids: [B] on the device, instead of host.input_ids (the tokens of the step before, when they are not on
        the host yet). stage: which staging block to fill; a lookahead step's number, whose block tables are step
        0's (not copied again). side: which set of staging blocks (0 or 1); consecutive steps alternate. A staging block
        is rewritten only by a later step on its side, after the caller has waited for that call's tokens (a sync),
        so its asynchronous copy has completed."""
        B, width = host.num_seqs, host.table_width
        size = next(s for s in self.sizes if s >= B)
        staging = self.staging[side, stage]
        values = (host.input_ids, host.positions, host.slot_mapping, host.state_slots, host.context_lens)
        staging[:, :B] = torch.tensor(values, dtype=torch.int64)
        staged = self.staged[side]
        if staged[stage] > B:  # columns a larger batch used: back to the padding row
            staging[:, B:staged[stage]] = self.padding[:, None]
        staged[stage] = B
        self.inputs.copy_(staging, non_blocking=True)
        if input_ids is not None:
            self.input_ids[:B].copy_(input_ids)
        if stage == 0:
            if self.table_staging[side].numel() < B * width:
                self.table_staging[side] = torch.zeros(max(B * width, 2 * self.table_staging[side].numel()),
                                                       dtype=torch.int64, pin_memory=self.staging.is_pinned())
            tables = host.block_table(out=self.table_staging[side][:B * width].view(B, width))
            self.block_tables[:B, :width].copy_(tables, non_blocking=True)  # entries past a context are never read
        self.graphs[size].replay()
        return self.logits[size][:B]

    def _batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            state_slots=self.state_slots[:size], block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size], num_decodes=size, query_lens=[1] * size,
            start_positions=[0] * size, state_slot_list=[self.scratch_slot] * size, in_graph=True)

    def _forward(self, size: int, batch: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(self.input_ids[:size], batch, self.caches))
