"""A step's block table: copied from each request's page tensor (RequestState.page_row) when it is wide, converted from
the lists when narrow; both give the same tensor, with or without a (stale) staging block to write into."""

import gc
import random

import pytest
import torch
from helpers.engine import as_inputs, random_prompts, token_ids

from deltaserve.runner import host_batch
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


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_an_engine_on_row_copied_tables_gives_the_tokens_of_the_list_path(make_llm, monkeypatch, prefix_caching):
    """Requests past ROW_COPY_MIN_PAGES pages (float32, the CPU) decode the same tokens whichever way the step's
    block table is built: the rows, or the lists (the threshold raised past every table)."""
    page = 16
    lengths = (ROW_COPY_MIN_PAGES * page + 37, 20, 2 * ROW_COPY_MIN_PAGES * page - 3)
    prompts = random_prompts(lengths, seed=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = {}
    for path, threshold in (("rows", ROW_COPY_MIN_PAGES), ("lists", 1 << 30)):
        monkeypatch.setattr(host_batch, "ROW_COPY_MIN_PAGES", threshold)
        llm = make_llm(max_model_len=4096, block_size=page, enable_prefix_caching=prefix_caching,
                       max_num_batched_tokens=512)
        outputs[path] = token_ids(llm.generate(as_inputs(prompts), params, use_tqdm=False))
    assert outputs["rows"] == outputs["lists"]
    assert all(len(tokens) == 12 for tokens in outputs["rows"])


@pytest.mark.parametrize("seed", range(4))
def test_cache_slots_of_a_chunk_are_each_tokens_cache_slot(seed):
    """A chunk's slots a run a page equal cache_slot a token, at ragged starts and counts (within a page, across
    several, none)."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 16, 64])
    pages = [rng.randrange(100_000) for _ in range(40)]
    for _ in range(30):
        start = rng.randrange(20 * block_size)
        count = rng.randint(0, 20 * block_size - start // 2)
        assert host_batch.cache_slots(pages, start, count, block_size) == [
            host_batch.cache_slot(pages, p, block_size) for p in range(start, start + count)]


@pytest.mark.parametrize("values", [list(range(5, 5 + 300)), [True, False] * 200, [-(2 ** 62)] * 256, [3] * 255])
def test_long_int_lists_reach_the_device_through_a_buffer_as_torch_tensor_makes_them(values):
    """to_device's buffer path (int64 lists of BUFFER_MIN_LEN or more) gives torch.tensor's tensor, and owns its
    memory once the list is gone."""
    from deltaserve.kernels.varlen import to_device

    want = torch.tensor(values, dtype=torch.int64)
    got = to_device(list(values), torch.int64, "cpu")
    gc.collect()  # the list and the array made from it are gone: the tensor keeps its buffer
    assert got.dtype == torch.int64 and torch.equal(got, want)


@pytest.mark.parametrize("seed", range(4))
def test_row_runs_give_the_slice_or_index_the_rows_would(seed):
    """A snapshot split's rows kept as runs: a slice where they follow one another, else the rows themselves."""
    rng = random.Random(seed)
    for _ in range(50):
        runs, start = [], rng.randrange(5)
        first = start
        for _ in range(rng.randint(1, 5)):
            start += rng.choice([0, 0, 1, 3]) if rng.random() < 0.3 else 0  # sometimes a gap
            length = rng.randint(0, 6)
            runs.append((start, start + length))
            start += length
        rows = [r for a, b in runs for r in range(a, b)]
        got = host_batch._rows(runs, lambda x: torch.tensor(x))
        if rows and rows == list(range(rows[0], rows[0] + len(rows))) or not rows:
            assert isinstance(got, slice) and list(range(100))[got] == rows
        else:
            assert torch.equal(got, torch.tensor(rows))
        assert host_batch._expand(runs) == rows and host_batch._consecutive(runs, first) == (
            rows == list(range(first, first + len(rows))))


@pytest.mark.parametrize("seed", range(4))
def test_the_inverse_of_row_runs_is_the_argsort_of_their_rows(seed):
    """A split step's rows in heads-then-tails order put back in token order: runs of a shuffled partition."""
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, 60), rng.randint(1, 8)))
        runs = list(zip([0] + cuts, cuts + [60]))
        runs += [(a, a) for a, _ in runs[: rng.randint(0, 2)]]  # empty runs hold no row
        rng.shuffle(runs)
        rows = torch.tensor(host_batch._expand(runs))
        assert host_batch._inverse(runs) == rows.argsort().tolist()
