"""DecodeGraphs' input staging, on the CPU: what a replay sees in the static buffers for batches that grow and
shrink (the graphs themselves need CUDA; tests/gpu/test_gpu_engine.py runs them)."""

import torch

from deltaserve.runner.cuda_graph import DecodeGraphs
from deltaserve.runner.forward_batch import HostBatch

SCRATCH_SLOT, SCRATCH_BLOCK, PAGE = 9, 30, 4


class Recorder:
    """Stands in for a captured graph: keeps what the static buffers hold at each replay."""

    def __init__(self, graphs: DecodeGraphs, size: int, seen: list):
        self.graphs, self.size, self.seen = graphs, size, seen

    def replay(self):
        self.seen.append((self.size, self.graphs.inputs.clone(), self.graphs.block_tables.clone()))


def staged_graphs(max_batch: int, max_blocks: int) -> tuple[DecodeGraphs, list]:
    graphs = DecodeGraphs(None, None, max_batch, max_blocks, PAGE, SCRATCH_SLOT, SCRATCH_BLOCK, torch.device("cpu"))
    seen = []
    for size in graphs.sizes:
        graphs.graphs[size] = Recorder(graphs, size, seen)
        graphs.logits[size] = torch.arange(size, dtype=torch.float32)[:, None].expand(size, 3)
    return graphs, seen


def decode_batch(gen: torch.Generator, B: int) -> HostBatch:
    starts = torch.randint(0, 40, (B,), generator=gen).tolist()
    tables = [torch.randint(0, SCRATCH_BLOCK, (s // PAGE + 1,), generator=gen).tolist() for s in starts]
    return HostBatch(input_ids=torch.randint(0, 100, (B,), generator=gen).tolist(), positions=starts,
                     slot_mapping=[t[s // PAGE] * PAGE + s % PAGE for t, s in zip(tables, starts)],
                     query_lens=[1] * B, start_positions=starts,
                     state_slots=torch.randperm(SCRATCH_SLOT, generator=gen)[:B].tolist(), block_tables=tables)


def test_each_replay_sees_the_batch_then_padding_rows_whatever_ran_before():
    graphs, seen = staged_graphs(max_batch=8, max_blocks=12)
    gen = torch.Generator().manual_seed(0)
    padding = [0, 0, SCRATCH_BLOCK * PAGE, SCRATCH_SLOT, 1]
    for B in (5, 1, 8, 3, 3, 7, 2):
        host = decode_batch(gen, B)
        assert graphs.can_run(host)
        logits = graphs.run(host)
        size, inputs, tables = seen[-1]
        assert size == next(s for s in graphs.sizes if s >= B) and logits.shape == (B, 3)
        expected = [host.input_ids, host.positions, host.slot_mapping, host.state_slots, host.context_lens]
        assert inputs[:, :B].tolist() == expected
        assert all(inputs[:, col].tolist() == padding for col in range(B, inputs.shape[1]))
        for row, table in enumerate(host.block_tables):
            assert tables[row, :len(table)].tolist() == table
        # a padding row reads its first table entry only: any valid page id
        assert all(0 <= tables[row, 0] <= SCRATCH_BLOCK for row in range(B, size))


def test_graphs_decline_prefill_more_rows_and_tables_wider_than_captured():
    graphs, _ = staged_graphs(max_batch=4, max_blocks=3)
    host = HostBatch([1, 2], [0, 1], [0, 1], [1, 1], [0, 0], [0, 1], [[1], [2]])
    assert graphs.can_run(host)
    host.block_tables[0] = [1, 2, 3, 4]
    assert not graphs.can_run(host)
    assert not graphs.can_run(HostBatch([1, 2, 3], [0, 1, 2], [0, 1, 2], [1, 2], [0, 0], [0, 1], [[1], [2]]))
    assert not graphs.can_run(HostBatch([1] * 5, [0] * 5, [0] * 5, [1] * 5, [0] * 5, list(range(5)), [[1]] * 5))
