"""DecodeGraphs' input staging, on the CPU: what a replay sees in the static buffers for batches that grow and
shrink (the graphs themselves need CUDA; tests/gpu/test_gpu_engine.py runs them)."""

import torch

from deltaserve.runner.cuda_graph import DecodeGraphs
from deltaserve.runner.host_batch import HostBatch

SCRATCH_SLOT, SCRATCH_BLOCK, PAGE = 9, 30, 4


class Recorder:
    """Stands in for a captured graph: keeps what the static buffers hold at each replay."""

    def __init__(self, graphs: DecodeGraphs, size: int, seen: list):
        self.graphs, self.size, self.seen = graphs, size, seen

    def replay(self):
        self.seen.append((self.size, self.graphs.inputs.clone(), self.graphs.block_tables.clone()))


def staged_graphs(max_batch: int, max_blocks: int, num_stages: int = 1) -> tuple[DecodeGraphs, list]:
    graphs = DecodeGraphs(None, None, max_batch, max_blocks, PAGE, SCRATCH_SLOT, SCRATCH_BLOCK, torch.device("cpu"),
                          num_stages=num_stages)
    seen = []
    for size in graphs.sizes:
        graphs.graphs[size] = Recorder(graphs, size, seen)
        graphs.logits[size] = torch.arange(size, dtype=torch.float32)[:, None].expand(size, 3)
    return graphs, seen


def decode_batch(gen: torch.Generator, B: int) -> HostBatch:
    starts = torch.randint(0, 40, (B,), generator=gen).tolist()
    # a page more than the context needs: a decode burst of up to PAGE steps has its pages already
    tables = [torch.randint(0, SCRATCH_BLOCK, (s // PAGE + 2,), generator=gen).tolist() for s in starts]
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


def test_a_burst_step_takes_its_input_ids_from_the_device_and_keeps_step_zeros_tables():
    graphs, seen = staged_graphs(max_batch=8, max_blocks=12, num_stages=3)
    gen = torch.Generator().manual_seed(2)
    host = decode_batch(gen, 3)
    graphs.run(host)
    tables = seen[-1][2]
    for step in (1, 2):
        later = host.advanced(step, PAGE)
        ids = torch.tensor([7, 8, 9])
        graphs.run(later, input_ids=ids, stage=step)
        _, inputs, step_tables = seen[-1]
        assert inputs[0, :3].tolist() == [7, 8, 9]
        assert inputs[1:, :3].tolist() == [later.positions, later.slot_mapping, later.state_slots, later.context_lens]
        assert torch.equal(step_tables, tables)
        assert later.context_lens == [p + step + 1 for p in host.positions]
        assert later.slot_mapping == [t[(p + step) // PAGE] * PAGE + (p + step) % PAGE
                                      for t, p in zip(host.block_tables, host.positions)]
