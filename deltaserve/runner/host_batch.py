"""HostBatch: a step's inputs as host lists, and where a token lies in the MLA cache (cache_slot)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.forward_batch import ForwardBatch, PrefillPass, SnapshotSplit
from deltaserve.kernels.varlen import pack_seqs, to_device

# block tables at least this wide (pages) are built by copying each request's pages from its tensor (table_rows: a
# fixed cost a row), narrower ones by converting the lists (a cost a page); benchmarks/host_step.py --prompt-len
ROW_COPY_MIN_PAGES = 64


def cache_slot(block_ids: list[int], position: int, block_size: int) -> int:
    """Where a sequence's token at `position` lies in the MLA cache: its page's first slot plus the offset."""
    return block_ids[position // block_size] * block_size + position % block_size


def cache_slots(block_ids: list[int], start: int, count: int, block_size: int) -> list[int]:
    """cache_slot of positions start..start+count-1, a run of slots a page (a prefill chunk: a range a page rather
    than a call a token, ~2.5x less host time at 8k tokens)."""
    slots, position, end = [], start, start + count
    while position < end:
        page, offset = divmod(position, block_size)
        run = min(end - position, block_size - offset)
        first = block_ids[page] * block_size + offset
        slots.extend(range(first, first + run))
        position += run
    return slots


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
    # prefix caching's saves inside a prefill chunk: (sequence, tokens of its chunk before the save, snapshot slot)
    snapshot_splits: list[tuple[int, int, int]] = field(default_factory=list)
    # the same block tables as int64 tensors, one a sequence (RequestState.page_row), where the caller keeps them:
    # a long context's table is copied from these instead of converted from its list
    table_rows: list[torch.Tensor] | None = None

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

    def block_table(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The block tables as one int64 tensor [B, table_width], padded with page 0 (into `out` when given: a
        staging block of that shape). Converting a list costs the host interpreter work a page (a 1M-token
        context's table holds 65k pages, every step), so a table of ROW_COPY_MIN_PAGES or more is copied from
        table_rows."""
        if self.table_rows is None or self.table_width < ROW_COPY_MIN_PAGES:
            table = torch.tensor(self.padded_tables(), dtype=torch.int64)
            return table if out is None else out.copy_(table)
        if out is None:
            out = torch.zeros(self.num_seqs, self.table_width, dtype=torch.int64)
        else:
            out.zero_()
        for i, row in enumerate(self.table_rows):
            out[i, :row.numel()] = row
        return out

    def advanced(self, steps: int, block_size: int) -> HostBatch:
        """This batch of decodes `steps` tokens later (a lookahead step): positions, cache slots and contexts moved on,
        the same pages (allocated for every lookahead step) and state slots; the input ids are the device's to fill
        (zeros here)."""
        positions = [p + steps for p in self.positions]
        return HostBatch(
            [0] * len(positions), positions,
            [cache_slot(table, p, block_size) for table, p in zip(self.block_tables, positions)],
            self.query_lens, [s + steps for s in self.start_positions], self.state_slots, self.block_tables,
            table_rows=self.table_rows)

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, ForwardBatch]:
        """(input_ids [N] int64, ForwardBatch) on device, copied without waiting for the device (to_device). On a GPU
        the prefill sequences are packed here, once for every layer; the CPU kernels read the host lists."""
        tensor = lambda x: to_device(x, torch.int64, device)  # noqa: E731
        batch = ForwardBatch(
            positions=tensor(self.positions), slot_mapping=tensor(self.slot_mapping),
            state_slots=tensor(self.state_slots), block_tables=self._device_table(device),
            context_lens=tensor(self.context_lens), num_decodes=sum(n == 1 for n in self.query_lens),
            query_lens=self.query_lens, start_positions=self.start_positions, state_slot_list=self.state_slots)
        if device.type == "cuda" and batch.num_decodes < batch.num_seqs:
            batch.prefill = pack_seqs(self.state_slots[batch.num_decodes:], batch.prefill_cu_seqlens(), device)
        if self.snapshot_splits:  # the KDA recurrence runs its passes instead of the prefill whole
            batch.snapshot_split = self._snapshot_split(batch.num_decodes, batch.prefill_cu_seqlens(), device)
        return tensor(self.input_ids), batch

    def _device_table(self, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self.block_table()
        table = self.block_table(torch.empty(self.num_seqs, self.table_width, dtype=torch.int64, pin_memory=True))
        return table.to(device, non_blocking=True)  # from pinned memory: no wait (kernels.varlen.to_device)

    def _snapshot_split(self, num_decodes: int, cu_seqlens: list[int], device: torch.device) -> SnapshotSplit:
        """The KDA layers' two passes over the prefill tokens for snapshot_splits (forward_batch.SnapshotSplit)."""
        at = {seq: (tokens, snapshot) for seq, tokens, snapshot in self.snapshot_splits}
        passes = {"heads": ([], [], [0]), "tails": ([], [], [0])}  # row runs (a, b), state slots, offsets
        split_slots, snapshot_slots, starts, cuts = [], [], [], []
        for seq in range(num_decodes, self.num_seqs):
            first, last = cu_seqlens[seq - num_decodes], cu_seqlens[seq - num_decodes + 1]
            cut = first + at[seq][0] if seq in at else last
            parts = [("heads", first, cut)] + ([("tails", cut, last)] if seq in at else [])
            for name, a, b in parts:
                runs, slots, cu = passes[name]
                runs.append((a, b))
                slots.append(self.state_slots[seq])
                cu.append(cu[-1] + b - a)
            if seq in at:
                split_slots.append(self.state_slots[seq])
                snapshot_slots.append(at[seq][1])
                starts.append(first)
                cuts.append(cut)
        tensor = lambda x: to_device(x, torch.int64, device)  # noqa: E731
        packed = lambda slots, cu: pack_seqs(slots, cu, device) if device.type == "cuda" else None  # noqa: E731
        heads, tails = (PrefillPass(_rows(runs, tensor), slots, cu, packed(slots, cu))
                        for runs, slots, cu in passes.values())
        order = passes["heads"][0] + passes["tails"][0]
        # the outputs' rows put back in token order; none when only the last prefill sequence is split
        inverse = None if _consecutive(order, 0) else tensor(_inverse(order))
        return SnapshotSplit(heads, tails, inverse, tensor(split_slots), tensor(snapshot_slots), tensor(starts),
                             tensor(cuts))


def _rows(runs: list[tuple[int, int]], tensor) -> torch.Tensor | slice:
    """Row runs [a, b) as a slice where they follow one another (a view of the tokens, no gather), else as an index
    tensor. Kept as runs until then: a step's rows are its prefill tokens, 8,192 at the default budget."""
    held = [(a, b) for a, b in runs if a < b]
    start = held[0][0] if held else 0
    return slice(start, held[-1][1] if held else 0) if _consecutive(held, start) else tensor(_expand(held))


def _consecutive(runs: list[tuple[int, int]], start: int) -> bool:
    """Whether the runs, in order, cover start, start + 1, ... without a gap or a repeat (empty runs hold no row)."""
    for a, b in runs:
        if a == b:
            continue
        if a != start:
            return False
        start = b
    return True


def _expand(runs: list[tuple[int, int]]) -> list[int]:
    rows = []
    for a, b in runs:
        rows.extend(range(a, b))
    return rows


def _inverse(runs: list[tuple[int, int]]) -> list[int]:
    """For runs that together hold rows 0..N-1 once each: where each row lies in their concatenation (the inverse
    of the permutation the runs spell, a range a run)."""
    placed, offset = [], 0
    for a, b in runs:
        placed.append((a, b, offset))
        offset += b - a
    inverse = []
    for a, b, at in sorted(placed):
        inverse.extend(range(at, at + b - a))
    return inverse
