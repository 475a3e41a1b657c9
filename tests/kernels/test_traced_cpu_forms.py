"""The CPU decode kernels' graph-safe forms, which torch.compile traces for EngineConfig.compile_decode (no host
reads: the conv update and the KDA step batched over state slots, the experts gathered), against the eager forms,
run here eagerly by making torch.compiler.is_compiling() say so. Fresh random inputs, ragged sizes, batches of 1
and 3 with scattered state slots."""

import pytest
import torch

from deltaserve.kernels.conv1d import causal_conv1d_update
from deltaserve.kernels.kda.fused_recurrent import fused_recurrent_kda
from deltaserve.kernels.moe.experts import fused_experts


def both(fn, monkeypatch):
    """(fn() eagerly, fn() in its traced form), each on its own copy of the inputs fn builds."""
    eager = fn()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = fn()
    monkeypatch.undo()
    return eager, traced


@pytest.mark.parametrize("slots", [[2], [4, 0, 3]])
def test_traced_conv_update_equals_the_eager_one(slots, monkeypatch):
    gen = torch.Generator().manual_seed(len(slots))
    x, weight, pool = torch.randn(len(slots), 37, generator=gen), torch.randn(37, 4, generator=gen), torch.randn(
        5, 37, 3, generator=gen)

    def run():
        state = pool.clone()
        return causal_conv1d_update(x, weight, state, torch.tensor(slots)), state

    (y, state), (y_t, state_t) = both(run, monkeypatch)
    assert torch.allclose(y, y_t, atol=1e-6) and torch.equal(state, state_t)


@pytest.mark.parametrize("slots", [[1], [3, 0, 2]])
def test_traced_kda_step_matches_the_in_place_one(slots, monkeypatch):
    gen = torch.Generator().manual_seed(7 + len(slots))
    B, H, K, V = len(slots), 3, 16, 24
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, K, generator=gen), dim=-1) for _ in range(2))
    v, g = torch.randn(B, H, V, generator=gen), -torch.rand(B, H, K, generator=gen)
    beta, pool = torch.rand(B, H, generator=gen), torch.randn(4, H, K, V, generator=gen)

    def run():
        state = pool.clone()
        return fused_recurrent_kda(q, k, v, g, beta, K ** -0.5, state, torch.tensor(slots)), state

    (o, state), (o_t, state_t) = both(run, monkeypatch)
    assert torch.allclose(o, o_t, atol=1e-5) and torch.allclose(state, state_t, atol=1e-5)


@pytest.mark.parametrize("T", [1, 3])
def test_traced_experts_match_the_grouped_ones(T, monkeypatch):
    gen = torch.Generator().manual_seed(T)
    E, k, D, I = 6, 3, 40, 24
    x, w13, w2 = torch.randn(T, D, generator=gen), torch.randn(E, 2 * I, D, generator=gen) * 0.2, torch.randn(
        E, D, I, generator=gen) * 0.2
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])  # distinct, unsorted
    weights = torch.rand(T, k, generator=gen)
    eager, traced = both(lambda: fused_experts(x, w13, w2, weights, ids), monkeypatch)
    assert torch.allclose(eager, traced, atol=1e-5)
