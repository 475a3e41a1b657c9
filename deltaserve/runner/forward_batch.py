"""ForwardBatch: the per-step metadata the model reads, passed explicitly (never a global).

Sequences are ordered decodes first: the first num_decodes sequences have exactly one new token each (a decode,
or a one-token prompt chunk), so their tokens are x[:num_decodes] and run through the batched recurrent paths;
the rest are prefill chunks, packed, through the chunked paths (prefill_packed: their index tensors, once a step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.kernels.varlen import PackedSeqs, to_device


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [N] int64, absolute position of each new token
    slot_mapping: torch.Tensor  # [N] int64, MLA cache index of each new token (block_id * block_size + offset)
    state_slots: torch.Tensor  # [B] int64, KDA conv + recurrent state slot of each sequence
    block_tables: torch.Tensor  # [B, max_blocks] int64, MLA pages of each sequence (padded with 0)
    context_lens: torch.Tensor  # [B] int64, tokens in the cache after this step
    num_decodes: int
    # host copies, for loops over prefill sequences without device syncs
    query_lens: list[int]  # new tokens per sequence
    start_positions: list[int]  # tokens already cached per sequence before this step
    state_slot_list: list[int]
    _packed: PackedSeqs | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def prefill_cu_seqlens(self) -> list[int]:
        """Offsets of the prefill sequences' tokens, relative to the first prefill token."""
        cu = [0]
        for n in self.query_lens[self.num_decodes:]:
            cu.append(cu[-1] + n)
        return cu

    def prefill_packed(self) -> PackedSeqs:
        """The prefill sequences' slots and offsets as tensors on this batch's device, made at the first call and
        shared by every layer after."""
        if self._packed is None:
            self._packed = PackedSeqs.build(self.state_slot_list[self.num_decodes:], self.prefill_cu_seqlens(),
                                            self.positions.device)
        return self._packed


def cache_slot(block_ids: list[int], position: int, block_size: int) -> int:
    """Where a sequence's token at `position` lies in the MLA cache: its page's first slot plus the offset."""
    return block_ids[position // block_size] * block_size + position % block_size


@dataclass
class HostBatch:
    """A step's inputs as host lists, before they go to the device: the eager path turns them into a ForwardBatch
    (to_device), a CUDA graph copies them into its static buffers (runner/cuda_graph.py)."""

    input_ids: list[int]  # [N]
    positions: list[int]  # [N]
    slot_mapping: list[int]  # [N]
    query_lens: list[int]  # [B]
    start_positions: list[int]  # [B]
    state_slots: list[int]  # [B]
    block_tables: list[list[int]]  # [B][pages of that sequence]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def context_lens(self) -> list[int]:
        return [start + n for start, n in zip(self.start_positions, self.query_lens)]

    @property
    def table_width(self) -> int:
        return max(len(table) for table in self.block_tables)

    def padded_tables(self) -> list[list[int]]:
        """The block tables as rows of table_width, padded with page 0 (never read: past each context)."""
        width = self.table_width
        return [table + [0] * (width - len(table)) for table in self.block_tables]

    def advanced(self, steps: int, block_size: int) -> HostBatch:
        """This batch of decodes `steps` tokens later (a decode burst): positions, cache slots and contexts moved on,
        the same pages (allocated for the whole burst) and state slots; the input ids are the device's to fill
        (zeros here)."""
        positions = [p + steps for p in self.positions]
        return HostBatch(
            [0] * len(positions), positions,
            [cache_slot(table, p, block_size) for table, p in zip(self.block_tables, positions)],
            self.query_lens, [s + steps for s in self.start_positions], self.state_slots, self.block_tables)

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, ForwardBatch]:
        """(input_ids [N] int64, ForwardBatch) on device, copied without waiting for the device (to_device)."""
        tensor = lambda x: to_device(x, torch.int64, device)  # noqa: E731
        return tensor(self.input_ids), ForwardBatch(
            positions=tensor(self.positions), slot_mapping=tensor(self.slot_mapping),
            state_slots=tensor(self.state_slots), block_tables=tensor(self.padded_tables()),
            context_lens=tensor(self.context_lens), num_decodes=sum(n == 1 for n in self.query_lens),
            query_lens=self.query_lens, start_positions=self.start_positions, state_slot_list=self.state_slots)
