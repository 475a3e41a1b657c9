"""chunk_kda (prefill) and fused_recurrent_kda (decode) against naive_recurrent_kda, the spec of the recurrence.

Inputs are fresh random tensors with realistic decays: g = -exp(A_log) * softplus(f + dt_bias), A_log in
log[1, 16] and dt_bias the inverse softplus of [1e-3, 1e-1], as the models initialise them. States live in a
pool of slots; the slots a call does not own hold 1e30 and must come back untouched.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deltaserve.kernels.kda import chunk_kda, fused_recurrent_kda, kda_gate, l2norm
from deltaserve.kernels.kda.naive import naive_recurrent_kda

H, K, V = 2, 16, 12  # V != K so that a swapped dimension cannot pass
NUM_SLOTS = 8
POISON = 1e30
TOL = dict(rtol=1e-5, atol=1e-5)


def kda_inputs(n: int, gen: torch.Generator, decay_offset: float = 0.0):
    """q, k (l2-normalised) [n, H, K], v [n, H, V], g [n, H, K] (<= 0), beta [n, H]; decay_offset shifts the
    softplus argument (8 makes every token decay by ~e^-8 to e^-130 per channel)."""
    q = F.normalize(torch.randn(n, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(n, H, K, generator=gen), dim=-1)
    v = torch.randn(n, H, V, generator=gen)
    a_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    dt = torch.empty(H * K).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    raw = torch.randn(n, H * K, generator=gen) + dt_bias + decay_offset
    g = -a_log.exp()[:, None] * F.softplus(raw).view(n, H, K)
    beta = torch.sigmoid(torch.randn(n, H, generator=gen))
    return q, k, v, g, beta


def state_pool(gen: torch.Generator, slots: list[int], random_init: bool) -> torch.Tensor:
    """[NUM_SLOTS, H, K, V]: the given slots zero or random, every other slot POISON."""
    pool = torch.full((NUM_SLOTS, H, K, V), POISON)
    for slot in slots:
        pool[slot] = torch.randn(H, K, V, generator=gen) if random_init else 0.0
    return pool


def naive(q, k, v, g, beta, state):
    """The spec over one sequence ([n, ...] tensors), from state [H, K, V]."""
    o, final = naive_recurrent_kda(q[None], k[None], v[None], g[None], beta[None], K ** -0.5, state[None])
    return o[0], final[0]


def check_untouched(pool: torch.Tensor, slots: list[int]) -> None:
    others = [s for s in range(NUM_SLOTS) if s not in slots]
    assert bool((pool[others] == POISON).all()), "a state slot the call does not own was written"


def check_chunk(lengths: list[int], chunk_size: int, random_init: bool, seed: int, decay_offset: float = 0.0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = kda_inputs(sum(lengths), gen, decay_offset)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[: len(lengths)].tolist()
    pool = state_pool(gen, slots, random_init)
    initial = pool.clone()
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    o = chunk_kda(q, k, v, g, beta, K ** -0.5, pool, slots, cu, chunk_size=chunk_size)
    for b, slot in enumerate(slots):
        span = slice(cu[b], cu[b + 1])
        want_o, want_state = naive(q[span], k[span], v[span], g[span], beta[span], initial[slot])
        torch.testing.assert_close(o[span], want_o, **TOL, msg=lambda m: f"sequence {b} ({lengths[b]} tokens): {m}")
        torch.testing.assert_close(pool[slot], want_state, **TOL, msg=lambda m: f"final state {b}: {m}")
    check_untouched(pool, slots)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("random_init", [False, True], ids=["zero-state", "random-state"])
@pytest.mark.parametrize("shape", ["1", "C-1", "C", "C+1", "packed"])
def test_chunk_matches_naive_at_ragged_lengths(chunk_size, random_init, shape):
    C = chunk_size
    lengths = {"1": [1], "C-1": [C - 1], "C": [C], "C+1": [C + 1], "packed": [1, C - 1, C, C + 1, 2 * C + 3]}[shape]
    check_chunk(lengths, chunk_size, random_init, seed=C + len(lengths))


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_does_not_overflow_under_strong_decay(chunk_size):
    """Per-token decays of e^-8 and beyond: a chunk's cumulative log decay reaches far below -100, where
    factoring exp(gc_i - gc_j) as exp(gc_i) * exp(-gc_j) overflows float32."""
    gen = torch.Generator().manual_seed(0)
    g = kda_inputs(chunk_size, gen, decay_offset=8.0)[3]
    assert g.cumsum(0).min() < -100  # the regime this test is about
    check_chunk([chunk_size + 3, 2 * chunk_size, 5], chunk_size, random_init=True, seed=0, decay_offset=8.0)


def test_chunk_with_mixed_decays_per_channel():
    """Some channels forget almost at once, others barely: both extremes in one chunk."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = kda_inputs(70, gen)
    g[:, :, : K // 2] *= 200.0  # tens to hundreds per token
    g[:, :, K // 2:] *= 1e-3
    pool = state_pool(gen, [2], random_init=True)
    initial = pool.clone()
    o = chunk_kda(q, k, v, g, beta, K ** -0.5, pool, [2], [0, 70], chunk_size=32)
    want_o, want_state = naive(q, k, v, g, beta, initial[2])
    torch.testing.assert_close(o, want_o, **TOL)
    torch.testing.assert_close(pool[2], want_state, **TOL)


@pytest.mark.parametrize("random_init", [False, True], ids=["zero-state", "random-state"])
def test_recurrent_matches_naive_step_by_step(random_init):
    """Three sequences decoding together from slots given out of order, 40 steps."""
    gen = torch.Generator().manual_seed(2)
    slots = [5, 0, 3]
    steps = 40
    inputs = [kda_inputs(steps, gen) for _ in slots]
    pool = state_pool(gen, slots, random_init)
    initial = pool.clone()
    outputs = []
    for t in range(steps):
        q, k, v, g, beta = (torch.stack([x[i][t] for x in inputs]) for i in range(5))
        outputs.append(fused_recurrent_kda(q, k, v, g, beta, K ** -0.5, pool, torch.tensor(slots)))
    for b, slot in enumerate(slots):
        want_o, want_state = naive(*inputs[b], initial[slot])
        torch.testing.assert_close(torch.stack([o[b] for o in outputs]), want_o, **TOL)
        torch.testing.assert_close(pool[slot], want_state, **TOL)
    check_untouched(pool, slots)


@pytest.mark.parametrize("prefill_len", [1, 63, 64, 65, 130])
def test_decode_continues_the_state_a_prefill_left(prefill_len):
    gen = torch.Generator().manual_seed(prefill_len)
    total = prefill_len + 10
    q, k, v, g, beta = kda_inputs(total, gen)
    pool = state_pool(gen, [6], random_init=True)
    initial = pool.clone()
    o = [chunk_kda(q[:prefill_len], k[:prefill_len], v[:prefill_len], g[:prefill_len], beta[:prefill_len],
                   K ** -0.5, pool, [6], [0, prefill_len])]
    for t in range(prefill_len, total):
        o.append(fused_recurrent_kda(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], K ** -0.5,
                                     pool, torch.tensor([6])))
    want_o, want_state = naive(q, k, v, g, beta, initial[6])
    torch.testing.assert_close(torch.cat(o), want_o, **TOL)
    torch.testing.assert_close(pool[6], want_state, **TOL)
    check_untouched(pool, [6])


def test_naive_matches_the_recurrence_written_out():
    """The oracle itself, against DESIGN.md's per-token formula on a 2-token, 1-head example."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = (x[:, :1] for x in kda_inputs(2, gen))
    S = torch.randn(1, K, V, generator=gen)
    o, final = naive(q, k, v, g, beta, S)
    state, expected = S[0].clone(), []
    for t in range(2):
        state = torch.diag(g[t, 0].exp()) @ state
        state = state + torch.outer(k[t, 0], beta[t, 0] * (v[t, 0] - k[t, 0] @ state))
        expected.append((q[t, 0] * K ** -0.5) @ state)
    torch.testing.assert_close(o[:, 0], torch.stack(expected), **TOL)
    torch.testing.assert_close(final[0], state, **TOL)


def test_l2norm_is_flas_form_not_f_normalize():
    """x / sqrt(sum(x^2) + 1e-6): for a vector of norm 1e-3 that is 1/sqrt(2) of F.normalize's unit vector."""
    x = torch.full((1, 4), 5e-4)  # norm 1e-3
    torch.testing.assert_close(l2norm(x), x / math.sqrt(1e-6 + 1e-6), rtol=1e-6, atol=0)
    y = torch.randn(3, 2, K, generator=torch.Generator().manual_seed(4)) * 3
    torch.testing.assert_close(l2norm(y), y / torch.sqrt((y * y).sum(-1, keepdim=True) + 1e-6), rtol=1e-6, atol=0)


def test_gate_is_minus_exp_a_log_times_softplus():
    """The reference's gate, softplus linear above 20, per head of K channels."""
    gen = torch.Generator().manual_seed(5)
    g_raw = torch.randn(6, H * K, generator=gen) * 10  # reaches both sides of the softplus threshold
    g_raw[0, :4] = torch.tensor([19.9, 20.0, 20.1, 35.0])
    dt_bias = torch.randn(H * K, generator=gen)
    a_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    x = g_raw + dt_bias
    softplus = torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
    expected = -a_log.exp()[:, None] * softplus.view(6, H, K)
    torch.testing.assert_close(kda_gate(g_raw, dt_bias, a_log), expected, rtol=1e-6, atol=1e-6)


def test_prefill_path_by_device_dtype_and_longest_sequence(monkeypatch):
    """The CPU and float32 keep the exact torch path; half precision on a GPU runs our recurrence up to
    RECURRENT_PREFILL_MAX_LEN tokens, fla-core's chunks past it (the torch path where fla-core is missing)."""
    from deltaserve.kernels import kda
    from deltaserve.kernels.kda import RECURRENT_PREFILL_MAX_LEN as M
    from deltaserve.kernels.kda import prefill_path
    from deltaserve.kernels.varlen import pack_seqs

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    short, long = [0, 1, M + 1], [0, M, 2 * M + 1]  # the longest sequence: M, and M + 1 tokens
    assert prefill_path(cpu, torch.bfloat16, [0, 1]) == prefill_path(cuda, torch.float32, [0, 1]) == "torch"
    monkeypatch.setattr(kda, "_fla_available", lambda: True)  # fla-core installed (it is not on this machine)
    assert prefill_path(cuda, torch.bfloat16, short) == prefill_path(cuda, torch.float16, [0, 1]) == "recurrent"
    assert prefill_path(cuda, torch.bfloat16, long) == "fla"
    assert prefill_path(cuda, torch.float32, long) == "torch"
    packed = pack_seqs([1, 2], long, cpu)  # its longest, where the runner packed the step
    assert packed.max_len == M + 1 and prefill_path(cuda, torch.bfloat16, long, packed) == "fla"
    monkeypatch.setattr(kda, "_fla_available", lambda: False)
    assert prefill_path(cuda, torch.bfloat16, long) == "torch"
