"""Our Triton kernels against their twins on the CPU, through Triton's interpreter (TRITON_INTERPRET=1), so CI
checks them without a GPU. On a machine with CUDA, tests/gpu runs the same kernels compiled instead."""

import pytest
import torch
from helpers.kernels import PagedLatents, kda_step_inputs, rel_err, require_triton_interpreter

require_triton_interpreter()

from deltaserve.kernels.gemv import GEMV_TILES, gemv  # noqa: E402
from deltaserve.kernels.kda import kda_decode_step  # noqa: E402
from deltaserve.kernels.kda.triton_decode import kda_decode_step as triton_kda_decode_step  # noqa: E402
from deltaserve.kernels.mla.attention import torch_mla_decode  # noqa: E402
from deltaserve.kernels.mla.triton_decode import triton_mla_decode  # noqa: E402
from deltaserve.kernels.moe.naive import naive_experts, naive_grouped_topk  # noqa: E402
from deltaserve.kernels.moe.triton_decode import decode_experts  # noqa: E402
from deltaserve.kernels.moe.triton_routing import _ROUTER_TILES, _arrivals, route, router_logits, triton_topk  # noqa: E402


@pytest.mark.parametrize("B,H,K,W", [(1, 2, 16, 4), (3, 4, 32, 4), (5, 1, 64, 2), (2, 4, 48, 4)])  # 48: the demo's
def test_kda_decode_step_kernel_matches_twin(B, H, K, W):
    """The fused step (conv, delta rule, gated norm) against the torch ops it replaces, its states included; rows
    strided as in_proj's split leaves them; slots no sequence uses poisoned and left as they were."""
    gen = torch.Generator().manual_seed(B * K + W)
    inputs = kda_step_inputs(B, H, K, W, B + 3, gen)
    twin = {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}
    o = triton_kda_decode_step(**inputs)
    o_twin = kda_decode_step(**twin)
    assert o.shape == (B, H * K) and rel_err(o, o_twin) < 1e-5
    slots = inputs["state_slots"]
    for name in ("state", "conv_state"):
        assert rel_err(inputs[name][slots], twin[name][slots]) < 1e-5
        unused = torch.ones(inputs[name].shape[0], dtype=torch.bool)
        unused[slots] = False
        assert torch.all(inputs[name][unused] == 1e30)


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (3, 16, 4)])
def test_decode_experts_kernel_matches_naive(T, E, k):
    gen = torch.Generator().manual_seed(T * E)
    D, I = 96, 40  # not multiples of the kernels' blocks: the masks are exercised
    x = torch.randn(T, D, generator=gen)
    w13 = torch.randn(E, 2 * I, D, generator=gen) * 0.1
    w2 = torch.randn(E, D, I, generator=gen) * 0.1
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    assert rel_err(decode_experts(x, w13, w2, weights, ids), naive_experts(x, w13, w2, weights, ids)) < 1e-5


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (4, 16, 8)])
def test_decode_experts_kernel_with_the_shared_expert_matches_naive(T, E, k):
    """The shared expert as one more slot (weight 1) of each token: the routed experts' sum plus its SwiGLU."""
    gen = torch.Generator().manual_seed(T * E + 1)
    D, I = 96, 40
    x = torch.randn(T, D, generator=gen)
    w13, shared13 = torch.randn(E, 2 * I, D, generator=gen) * 0.1, torch.randn(2 * I, D, generator=gen) * 0.1
    w2, shared2 = torch.randn(E, D, I, generator=gen) * 0.1, torch.randn(D, I, generator=gen) * 0.1
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    gate, up = (x @ shared13.T).chunk(2, dim=-1)
    expected = naive_experts(x, w13, w2, weights, ids) + (torch.nn.functional.silu(gate) * up) @ shared2.T
    assert rel_err(decode_experts(x, w13, w2, weights, ids, shared=(shared13, shared2)), expected) < 1e-5


@pytest.mark.parametrize("T,E,k,renormalize", [(1, 256, 8, True), (5, 40, 3, False), (2, 7, 7, True)])
def test_routing_kernel_matches_naive(T, E, k, renormalize):
    """The one-kernel router against the naive grouped top-k with every group kept; ids compared as sets per token
    (the kernel's order is by score), weights matched to their ids."""
    gen = torch.Generator().manual_seed(T * E + k)
    logits, bias = torch.randn(T, E, generator=gen) * 2, torch.randn(E, generator=gen) * 0.1
    weights, ids = triton_topk(logits, bias, k, renormalize, 2.446)
    ref_weights, ref_ids = naive_grouped_topk(logits, bias, k, 1, 1, renormalize, 2.446)
    for t in range(T):
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        want = dict(zip(ref_ids[t].tolist(), ref_weights[t].tolist()))
        assert got.keys() == want.keys()
        assert all(abs(got[e] - want[e]) <= 1e-6 * abs(want[e]) + 1e-7 for e in want)
    biased = logits.sigmoid() + bias
    assert torch.equal(biased.gather(1, ids), biased.gather(1, ids).sort(dim=1, descending=True)[0])  # by score


def test_routing_kernel_gives_distinct_valid_ids_for_a_nan_row():
    """A token whose hidden state went NaN must not index past the experts (an illegal access kills the GPU)."""
    logits = torch.randn(2, 40)
    logits[1] = float("nan")
    _, ids = triton_topk(logits, torch.zeros(40), 8, True, 1.0)
    assert ids.min() >= 0 and ids.max() < 40 and len(set(ids[1].tolist())) == 8


@pytest.mark.parametrize("lengths,H,R,DR,page,width", [
    ([1], 3, 32, 16, 4, None),
    ([5, 1, 70, 33], 20, 48, 8, 8, None),  # two head blocks, the second ragged; R and Dr not powers of two
    ([40, 2], 16, 64, 16, 16, 64),  # a table far wider than the contexts, as a CUDA graph's: entries past unread
])
def test_mla_decode_kernel_matches_torch_twin(lengths, H, R, DR, page, width):
    """Paged, split-context MLA decode against the torch path (gather every page, masked softmax)."""
    gen = torch.Generator().manual_seed(sum(lengths) * H)
    paged = PagedLatents(lengths, R + DR, page, 64, gen)
    tables = paged.block_tables(width)
    B = len(lengths)
    q_latent = torch.randn(H, B, R, generator=gen).transpose(0, 1)  # strided rows, as the absorbed query's
    q_rope = torch.randn(B, H, 2 * DR, generator=gen)[..., DR:]
    lens = torch.tensor(lengths)
    twin = torch_mla_decode(q_latent, q_rope, paged.cache, tables, lens, 0.3)
    out = triton_mla_decode(q_latent, q_rope, paged.cache, tables, lens, 0.3)
    assert rel_err(out, twin) < 1e-5


@pytest.mark.parametrize("tile", [None, *_ROUTER_TILES])  # None: the (interpreter's one) autotuned config
@pytest.mark.parametrize("T,E,D", [(1, 256, 2304), (3, 10, 100)])
def test_router_logits_kernel_matches_float32_linear(T, E, D, tile):
    """bf16 activations (a strided view, as a split leaves them) against float32 weights, widened in the kernel."""
    gen = torch.Generator().manual_seed(T * E)
    x = torch.randn(T, 2 * D, generator=gen).bfloat16()[:, :D]
    weight = torch.randn(E, D, generator=gen) * 0.05
    assert rel_err(router_logits(x, weight, tile), torch.nn.functional.linear(x.float(), weight)) < 1e-6


@pytest.mark.parametrize("tile", [None, (1, 1024), (8, 256)])  # None: the (interpreter's one) autotuned config
@pytest.mark.parametrize("T,E,D,k", [(1, 256, 2304, 8), (3, 10, 100, 3), (16, 40, 64, 8)])
def test_route_kernel_is_router_logits_then_topk(T, E, D, k, tile):
    """Logits and choice in one launch (the last program of a token routes it) against the two kernels it fuses;
    twice in a row, as a graph replays it, since the arrival counts must be back at zero after each launch."""
    gen = torch.Generator().manual_seed(T * E + k)
    x = torch.randn(T, 2 * D, generator=gen).bfloat16()[:, :D]
    weight, bias = torch.randn(E, D, generator=gen) * 0.05, torch.randn(E, generator=gen) * 0.1
    expected = triton_topk(router_logits(x, weight, tile), bias, k, True, 2.446)
    for _ in range(2):
        weights, ids = route(x, weight, bias, k, True, 2.446, tile)
        assert torch.equal(ids, expected[1]) and rel_err(weights, expected[0]) < 1e-6
        assert not _arrivals[x.device].any()


@pytest.mark.parametrize("tile", [None, *GEMV_TILES])  # None: the (interpreter's one) autotuned config
@pytest.mark.parametrize("T,N,K", [(1, 70, 300), (3, 129, 1100), (4, 16, 48)])
def test_gemv_kernel_matches_linear(T, N, K, tile):
    """bf16 activations (a strided view, as a split leaves them) and weights at ragged shapes, against the float32
    product rounded once to bf16."""
    gen = torch.Generator().manual_seed(T * N + K)
    x = torch.randn(T, 2 * K, generator=gen).bfloat16()[:, :K]
    weight = (torch.randn(N, K, generator=gen) * 0.05).bfloat16()
    y = gemv(x, weight, tile)
    assert y.dtype == torch.bfloat16 and y.shape == (T, N)
    assert rel_err(y, torch.nn.functional.linear(x.float(), weight.float())) < 5e-3


@pytest.mark.parametrize("tile", [None, *GEMV_TILES])
def test_grouped_gemv_gives_each_group_its_own_input(tile):
    """KDA's two gate up-projections in one launch: rows [0, N/2) from x[:, :K], rows [N/2, N) from x[:, K:]."""
    gen = torch.Generator().manual_seed(5)
    K, half = 48, 128
    x = torch.randn(1, 3 * 2 * K, generator=gen).bfloat16()[:, : 2 * K]
    weight = (torch.randn(2 * half, K, generator=gen) * 0.1).bfloat16()
    y = gemv(x, weight, tile, groups=2)
    F = torch.nn.functional
    assert rel_err(y[:, :half], F.linear(x[:, :K].float(), weight[:half].float())) < 5e-3
    assert rel_err(y[:, half:], F.linear(x[:, K:].float(), weight[half:].float())) < 5e-3
