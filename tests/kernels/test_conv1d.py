"""KDA's short causal conv: causal_conv1d_varlen (prefill chunks) and causal_conv1d_update (decode) against
naive_causal_conv1d, with the conv state carried across chunk splits and slots given out of order."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen, conv_states_at
from deltaserve.kernels.kda.naive import naive_causal_conv1d

D = 12
NUM_SLOTS = 6
POISON = 1e30
TOL = dict(rtol=1e-6, atol=1e-6)


def conv_pool(gen, width: int, slots: list[int], channels: int = D) -> torch.Tensor:
    """[NUM_SLOTS, channels, W-1]: random tails in the given slots, POISON elsewhere."""
    pool = torch.full((NUM_SLOTS, channels, width - 1), POISON)
    for slot in slots:
        pool[slot] = torch.randn(channels, width - 1, generator=gen)
    return pool


def check_untouched(pool, slots):
    others = [s for s in range(NUM_SLOTS) if s not in slots]
    assert bool((pool[others] == POISON).all()), "a conv state slot the call does not own was written"


@pytest.mark.parametrize("width", [2, 3, 4])
def test_varlen_matches_naive_on_packed_sequences(width):
    """Sequences shorter than, equal to and longer than the kernel, each continuing its own state."""
    gen = torch.Generator().manual_seed(width)
    lengths = [1, width - 1, width, width + 1, 17]
    slots = [4, 1, 5, 0, 2]
    x = torch.randn(sum(lengths), D, generator=gen)
    weight = torch.randn(D, width, generator=gen)
    pool = conv_pool(gen, width, slots)
    initial = pool.clone()
    cu = torch.tensor([0] + lengths).cumsum(0).tolist()
    y = causal_conv1d_varlen(x, weight, pool, slots, cu)
    for b, slot in enumerate(slots):
        want_y, want_state = naive_causal_conv1d(x[cu[b]: cu[b + 1]], weight, initial[slot])
        torch.testing.assert_close(y[cu[b]: cu[b + 1]], want_y, **TOL)
        torch.testing.assert_close(pool[slot], want_state, **TOL)
    check_untouched(pool, slots)


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("pieces", [[5, 1, 1, 2, 1, 7, 1, 3], [1, 1, 1, 1, 17], [3, 3, 3, 3, 3, 6]])
def test_any_chunk_split_equals_one_pass(width, pieces):
    """One sequence fed in pieces (single tokens through update, longer ones through varlen) gives the same
    output and final state as one naive pass from a zero state."""
    gen = torch.Generator().manual_seed(width * 100 + len(pieces))
    x = torch.randn(sum(pieces), D, generator=gen)
    weight = torch.randn(D, width, generator=gen)
    pool = conv_pool(gen, width, [3])
    pool[3] = 0.0
    outputs, start = [], 0
    for n in pieces:
        if n == 1:
            outputs.append(causal_conv1d_update(x[start: start + 1], weight, pool, torch.tensor([3])))
        else:
            outputs.append(causal_conv1d_varlen(x[start: start + n], weight, pool, [3], [0, n]))
        start += n
    want_y, want_state = naive_causal_conv1d(x, weight)
    torch.testing.assert_close(torch.cat(outputs), want_y, **TOL)
    torch.testing.assert_close(pool[3], want_state, **TOL)
    check_untouched(pool, [3])


def test_varlen_single_token_equals_update():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, D, generator=gen)
    weight = torch.randn(D, 4, generator=gen)
    pool_a = conv_pool(gen, 4, [2])
    pool_b = pool_a.clone()
    y_a = causal_conv1d_varlen(x, weight, pool_a, [2], [0, 1])
    y_b = causal_conv1d_update(x, weight, pool_b, torch.tensor([2]))
    torch.testing.assert_close(y_a, y_b, **TOL)
    torch.testing.assert_close(pool_a, pool_b, **TOL)


def test_update_of_one_sequence_is_bitwise_its_row_in_a_batch():
    """Batch 1 takes its own path (the state row as a view): the same bits as the batched gather and scatter.
    Channels a multiple of the widest CPU vector (16 floats), as every real model's are: PyTorch's SiLU computes
    a tensor's last partial vector in scalar code, which rounds differently on some CPUs, so with 12 channels
    the lone row's tail and the batch's vectorised copy of it may differ by an ulp."""
    gen = torch.Generator().manual_seed(9)
    D = 64
    weight = torch.randn(D, 4, generator=gen)
    x = torch.randn(5, 2, D, generator=gen)
    pool = conv_pool(gen, 4, [4, 1], D)
    initial, alone = pool.clone(), pool.clone()
    for t in range(5):
        batched = causal_conv1d_update(x[t], weight, pool, torch.tensor([4, 1]))
        assert torch.equal(causal_conv1d_update(x[t, :1], weight, alone, torch.tensor([4])), batched[:1])
    assert torch.equal(alone[4], pool[4]) and torch.equal(alone[1], initial[1])
    check_untouched(alone, [4, 1])


def test_update_batch_in_unsorted_slots():
    """Four sequences decode together for 6 steps; each keeps its own tail."""
    gen = torch.Generator().manual_seed(8)
    slots = [3, 0, 5, 1]
    weight = torch.randn(D, 4, generator=gen)
    x = torch.randn(6, len(slots), D, generator=gen)
    pool = conv_pool(gen, 4, slots)
    initial = pool.clone()
    ys = torch.stack([causal_conv1d_update(x[t], weight, pool, torch.tensor(slots)) for t in range(6)])
    for b, slot in enumerate(slots):
        want_y, want_state = naive_causal_conv1d(x[:, b], weight, initial[slot])
        torch.testing.assert_close(ys[:, b], want_y, **TOL)
        torch.testing.assert_close(pool[slot], want_state, **TOL)
    check_untouched(pool, slots)


def test_naive_is_silu_of_a_causal_weighted_sum():
    """The oracle against the formula y_t = silu(sum_i w[:, i] * x_{t - (W-1) + i}), zeros before the start."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, D, generator=gen)
    weight = torch.randn(D, 3, generator=gen)
    padded = torch.cat([torch.zeros(2, D), x])
    expected = torch.stack([torch.nn.functional.silu((weight.t() * padded[t: t + 3]).sum(0)) for t in range(5)])
    y, state = naive_causal_conv1d(x, weight)
    torch.testing.assert_close(y, expected, **TOL)
    torch.testing.assert_close(state, x[-2:].t(), **TOL)


@pytest.mark.parametrize("width", [2, 4])
def test_states_at_equal_the_state_a_varlen_pass_leaves(width):
    """conv_states_at's state for x[start:end] is the state causal_conv1d_varlen leaves after those inputs, from
    the same slot: at cuts before, inside and past the kernel's width, the cut at the first token included."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(40, D, generator=gen)
    weight = torch.randn(D, width, generator=gen)
    pool = conv_pool(gen, width, [1, 2, 4])
    snapshots = torch.full((NUM_SLOTS, D, width - 1), POISON)
    bounds = [(1, 0, 0), (2, 5, 6), (4, 10, 33)]  # (slot, start, end)
    slots, starts, ends = (torch.tensor(column) for column in zip(*bounds))
    conv_states_at(x, pool, snapshots, slots, torch.tensor([3, 0, 5]), starts, ends)
    for (slot, start, end), snapshot in zip(bounds, [3, 0, 5]):
        after = pool.clone()
        if end > start:  # no tokens: the state as it was
            causal_conv1d_varlen(x[start:end], weight, after, [slot], [0, end - start])
        assert torch.equal(snapshots[snapshot], after[slot])
    check_untouched(snapshots, [3, 0, 5])


def test_varlen_in_groups_is_a_view_of_the_whole_and_takes_no_tokens():
    """groups > 1 on the CPU: the same values, viewed [N, groups, D / groups]; a step with no prefill tokens too."""
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(9, D, generator=gen), torch.randn(D, 4, generator=gen)
    pool_a = conv_pool(gen, 4, [1])
    pool_b = pool_a.clone()
    y = causal_conv1d_varlen(x, weight, pool_a, [1], [0, 9], groups=3)
    assert y.shape == (9, 3, D // 3) and torch.equal(y.reshape(9, D), causal_conv1d_varlen(x, weight, pool_b, [1],
                                                                                            [0, 9]))
    assert causal_conv1d_varlen(x[:0], weight, pool_a, [], [0], groups=3).shape == (0, 3, D // 3)
