"""A step's block table: copied from each request's page tensor (RequestState.page_row) when it is wide, converted from
the lists when narrow; both give the same tensor, with or without a (stale) staging block to write into."""

import random

import pytest
import torch

from deltaserve.runner.host_batch import ROW_COPY_MIN_PAGES, HostBatch
from deltaserve.runner.step_sampler import RequestState
from deltaserve.sampling_params import SamplingParams


def _states(rng: random.Random, lengths: list[int]) -> list[RequestState]:
    """Requests whose pages arrive in ragged pieces, as a decode's and a prefill chunk's allocations do."""
    states = []
    for i, n in enumerate(lengths):
        first = rng.randint(0, n)
        state = RequestState(str(i), [1], 1, SamplingParams(), [rng.randrange(10_000) for _ in range(first)], i, 0)
        while len(state.block_ids) < n:
            state.add_pages([rng.randrange(10_000) for _ in range(rng.randint(1, n - len(state.block_ids)))])
        states.append(state)
    return states


def _host(states: list[RequestState], rows: bool) -> HostBatch:
    B = len(states)
    return HostBatch([0] * B, [0] * B, [0] * B, [1] * B, [0] * B, list(range(B)), [s.block_ids for s in states],
                     table_rows=[s.page_row for s in states] if rows else None)


@pytest.mark.parametrize("seed", range(6))
def test_row_copies_equal_the_lists_at_ragged_widths(seed):
    rng = random.Random(seed)
    widest = rng.choice([ROW_COPY_MIN_PAGES - 1, ROW_COPY_MIN_PAGES, 3 * ROW_COPY_MIN_PAGES + 5])
    states = _states(rng, [rng.randint(1, widest) for _ in range(rng.randint(1, 9))] + [widest])
    rng.shuffle(states)
    want = torch.tensor(_host(states, rows=False).padded_tables(), dtype=torch.int64)
    for state in states:
        assert state.page_row.tolist() == state.block_ids
    fast = _host(states, rows=True)
    assert torch.equal(fast.block_table(), want)
    stale = torch.full(want.shape, 77_777, dtype=torch.int64)  # a staging block that held an earlier step's tables
    assert fast.block_table(out=stale) is stale and torch.equal(stale, want)


def test_page_row_views_keep_their_pages_as_the_table_grows():
    state = RequestState("r", [1], 1, SamplingParams(), [], 0, 0)
    views = []
    for page in range(100):  # past several doublings of the tensor
        state.add_pages([page])
        views.append(state.page_row)
    assert all(view.tolist() == list(range(n + 1)) for n, view in enumerate(views))
    assert state.block_ids == list(range(100))
