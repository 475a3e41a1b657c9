"""The MoE kernels: grouped_topk (Kimi's router) and fused_experts against their naive twins, plus the router's
rules on hand-made scores (the bias chooses but does not weigh; a group scores the sum of its top two)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.moe import fused_experts, grouped_topk
from deltaserve.kernels.moe.naive import naive_experts, naive_grouped_topk

ROUTERS = [  # (num_experts, top_k, num_groups, topk_group, renormalize, routed_scaling_factor)
    (8, 2, 2, 1, True, 2.446),
    (16, 4, 4, 2, False, 1.0),
    (32, 8, 8, 4, True, 2.446),
    (6, 1, 1, 1, True, 1.0),
    (12, 3, 3, 2, True, 1.5),
    (256, 8, 1, 1, True, 2.446),  # the 48B model's router
    (256, 8, 8, 4, True, 2.446),  # DeepSeek-V3's grouping at the same size
]


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    """Per token, expert id -> weight (the kernels need not order the chosen experts)."""
    return [dict(zip(i.tolist(), w.tolist())) for w, i in zip(weights, ids)]


@pytest.mark.parametrize("E,k,groups,topk_group,renorm,scale", ROUTERS)
def test_grouped_topk_matches_naive(E, k, groups, topk_group, renorm, scale):
    gen = torch.Generator().manual_seed(E + k)
    logits = torch.randn(40, E, generator=gen) * 2.0
    bias = torch.randn(E, generator=gen) * 0.1
    weights, ids = grouped_topk(logits, bias, k, groups, topk_group, renorm, scale)
    want_weights, want_ids = naive_grouped_topk(logits, bias, k, groups, topk_group, renorm, scale)
    assert ids.shape == (40, k) and weights.dtype == torch.float32
    for t, (got, want) in enumerate(zip(by_expert(weights, ids), by_expert(want_weights, want_ids))):
        assert got.keys() == want.keys(), f"token {t}: experts {sorted(got)} != {sorted(want)}"
        for e in want:
            assert got[e] == pytest.approx(want[e], rel=1e-6), f"token {t}, expert {e}"
    if renorm:
        torch.testing.assert_close(weights.sum(-1), torch.full((40,), scale))


def test_bias_chooses_but_does_not_weigh():
    logits = torch.logit(torch.tensor([[0.9, 0.5, 0.2, 0.1]]))  # sigmoid scores 0.9, 0.5, 0.2, 0.1
    bias = torch.tensor([0.0, 0.5, 0.0, 0.0])  # lifts expert 1 above expert 0 for the choice only
    weights, ids = grouped_topk(logits, bias, 1, 1, 1, False, 2.0)
    assert ids.tolist() == [[1]]
    assert weights.item() == pytest.approx(0.5 * 2.0)  # its unbiased score, scaled
    weights, ids = grouped_topk(logits, bias, 2, 1, 1, True, 2.0)
    assert by_expert(weights, ids) == [pytest.approx({0: 0.9 / 1.4 * 2.0, 1: 0.5 / 1.4 * 2.0})]


def test_a_group_scores_the_sum_of_its_top_two():
    """Group A holds the single best expert (0.95) but its top two sum to 1.05; group B's sum to 1.2, so with
    one group kept the best expert is not chosen."""
    scores = torch.tensor([[0.95, 0.10, 0.05, 0.05, 0.60, 0.60, 0.05, 0.05]])
    weights, ids = grouped_topk(torch.logit(scores), torch.zeros(8), 2, 2, 1, True, 1.0)
    assert sorted(ids[0].tolist()) == [4, 5]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5]]))


@pytest.mark.parametrize("E,k,T", [
    (8, 2, 1),  # one decode token
    (8, 2, 32),  # 64 (token, expert) pairs: the small-batch grouping
    (16, 4, 40),  # 160 pairs: the large-batch grouping
    (32, 8, 5),
    (6, 1, 50),
])
def test_fused_experts_match_naive(E, k, T):
    gen = torch.Generator().manual_seed(E * 100 + T)
    D, I = 24, 10
    x = torch.randn(T, D, generator=gen)
    w13 = torch.randn(E, 2 * I, D, generator=gen) * 0.2
    w2 = torch.randn(E, D, I, generator=gen) * 0.2
    weights, ids = grouped_topk(torch.randn(T, E, generator=gen), torch.zeros(E), k, 1, 1, True, 2.446)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), naive_experts(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_fused_experts_with_every_token_on_the_same_experts():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(70, 16, generator=gen)
    w13, w2 = torch.randn(4, 12, 16, generator=gen) * 0.2, torch.randn(4, 16, 6, generator=gen) * 0.2
    ids = torch.tensor([[3, 1]] * 70)
    weights = torch.rand(70, 2, generator=gen)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), naive_experts(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_one_token_is_bitwise_its_row_among_tokens_on_other_experts():
    """One token takes its own path (no grouping): the same bits as the grouped path, where its experts see it alone."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, generator=gen)
    w13, w2 = torch.randn(6, 12, 16, generator=gen) * 0.2, torch.randn(6, 16, 6, generator=gen) * 0.2
    ids, weights = torch.tensor([[4, 1], [0, 5]]), torch.rand(2, 2, generator=gen)
    assert torch.equal(fused_experts(x[:1], w13, w2, weights[:1], ids[:1]), fused_experts(x, w13, w2, weights, ids)[:1])


@pytest.mark.parametrize("min_weight", ["none", "per_call"])
def test_one_token_is_bitwise_its_row_in_a_step_of_a_few_tokens(monkeypatch, min_weight):
    """kernels.cpu_gemv serves one token's k experts in one call where the k weights reach MIN_WEIGHT together; a step
    of up to 4 tokens takes the same rule expert by expert, so a token's bits are the same alone and beside others
    (also where one expert's weight alone is under the limit). PyTorch's products promise no such thing (MKL's
    sums at 1 and 2 rows differ), hence the test above, where each expert sees its token alone."""
    from deltaserve.kernels import cpu_gemv

    if not cpu_gemv.available():
        pytest.skip("no C compiler or no AVX2/AVX-512 here")
    gen = torch.Generator().manual_seed(4)
    E, k, D, I = 6, 2, 64, 32
    single = 2 * I * D  # one expert's w13
    monkeypatch.setattr(cpu_gemv, "MIN_WEIGHT", {"none": 0, "per_call": single + 1}[min_weight])
    x = torch.randn(3, D, generator=gen)
    w13, w2 = torch.randn(E, 2 * I, D, generator=gen) * 0.2, torch.randn(E, D, I, generator=gen) * 0.2
    ids, weights = torch.tensor([[4, 1], [1, 5], [0, 4]]), torch.rand(3, k, generator=gen)
    together = fused_experts(x, w13, w2, weights, ids, cpu_threads=1)
    for t in range(3):
        assert torch.equal(fused_experts(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1], cpu_threads=1)[0],
                           together[t])


def test_naive_experts_is_the_weighted_sum_of_swiglus():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 8, generator=gen)
    w13, w2 = torch.randn(3, 10, 8, generator=gen), torch.randn(3, 8, 5, generator=gen)
    ids, weights = torch.tensor([[2, 0]]), torch.tensor([[0.7, 0.3]])

    def swiglu(e):
        gate, up = w13[e, :5] @ x[0], w13[e, 5:] @ x[0]
        return w2[e] @ (torch.nn.functional.silu(gate) * up)

    torch.testing.assert_close(naive_experts(x, w13, w2, weights, ids)[0], 0.7 * swiglu(2) + 0.3 * swiglu(0))


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (7, 16, 4), (33, 64, 8)])
def test_grouped_experts_match_naive_and_are_deterministic(T, E, k):
    """The GPU path (grouped GEMMs, a permutation instead of atomics) runs on the CPU too in bfloat16."""
    from deltaserve.kernels.moe.experts import grouped_experts

    gen = torch.Generator().manual_seed(T * E)
    D, I = 64, 32
    x = torch.randn(T, D, generator=gen).bfloat16()
    w13 = (torch.randn(E, 2 * I, D, generator=gen) * 0.1).bfloat16()
    w2 = (torch.randn(E, D, I, generator=gen) * 0.1).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    out = grouped_experts(x, w13, w2, weights, ids)
    ref = naive_experts(x, w13, w2, weights, ids)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(out, grouped_experts(x, w13, w2, weights, ids))


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_grouped_experts_in_chunks_equal_all_at_once_bitwise(chunk):
    """Experts a chunk at a time (FP8 prefill: each chunk's weights dequantized on the fly), experts of a chunk
    unhit, and chunks that do not divide E: the same bits as one grouped pass over all experts."""
    from deltaserve.kernels.moe.experts import grouped_experts, grouped_experts_in_chunks
    from deltaserve.kernels.quant import dequantize_fp8, quantize_fp8

    gen = torch.Generator().manual_seed(chunk)
    T, E, k, D, I, block = 40, 16, 4, 64, 32, (16, 32)
    x = torch.randn(T, D, generator=gen).bfloat16()
    w13, s13 = quantize_fp8(torch.randn(E, 2 * I, D, generator=gen) * 0.1, block)
    w2, s2 = quantize_fp8(torch.randn(E, D, I, generator=gen) * 0.1, block)
    pool = torch.tensor([0, 1, 2, 3, 9, 10, 11, 15])  # experts 4-8 and 12-14 never hit
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    made = []

    def weights_of(e0, e1):
        made.append((e0, e1))
        return (dequantize_fp8(w13[e0:e1], s13[e0:e1], block, torch.bfloat16),
                dequantize_fp8(w2[e0:e1], s2[e0:e1], block, torch.bfloat16))

    out = grouped_experts_in_chunks(x, weights, ids, E, chunk, weights_of)
    assert torch.equal(out, grouped_experts(x, *weights_of(0, E), weights, ids))
    assert all(e1 - e0 <= chunk for e0, e1 in made[:-1]) and (4, 5) not in made  # unhit chunks are skipped


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (64, 256, 8), (40, 4, 2), (7, 3, 3)])
def test_expert_blocks_cover_every_pair_once_within_their_bound(T, E, k):
    """The block layout of kernels.moe.triton_blocks (its torch twin; test_triton_interpreted holds the kernel to
    it): each (token, slot) pair in exactly one block, every block's rows on its expert, at most 16 rows a block,
    and the blocks past the last empty."""
    from deltaserve.kernels.moe.triton_blocks import BLOCK_M, torch_expert_blocks

    gen = torch.Generator().manual_seed(T * E)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    order, expert, first, rows, where = torch_expert_blocks(ids, E)
    assert torch.equal(order[where], torch.arange(T * k))  # each pair's row
    assert rows.numel() == min(E, T * k) + T * k // BLOCK_M and int(rows.max()) <= BLOCK_M
    covered = []
    for e, f, n in zip(expert.tolist(), first.tolist(), rows.tolist()):
        pairs = order[f:f + n].tolist()
        assert all(int(ids.flatten()[p]) == e for p in pairs)
        covered += pairs
    assert sorted(covered) == list(range(T * k))
    used = int((rows > 0).sum())
    assert bool((rows[used:] == 0).all()) and used == sum(-(-int((ids == e).sum()) // BLOCK_M) for e in range(E))


def test_copy_rows_twin_in_chunks_copies_every_pair(monkeypatch):
    """copy_rows' torch path gathers a bounded number of rows at a time: with room for two, five pairs still land
    each in its place, and the rows not named stay."""
    from deltaserve.kernels import cache_ops

    source, target = torch.randn(3, 8, 4, 5), torch.randn(3, 9, 4, 5)
    want = target.clone()
    src, dst = torch.tensor([7, 0, 3, 5, 1]), torch.tensor([2, 8, 0, 4, 6])
    want[:, dst] = source[:, src]
    monkeypatch.setattr(cache_ops, "_COPY_CHUNK_BYTES", 2 * 3 * 4 * 5 * 4)
    cache_ops.copy_rows(source, target, src, dst)
    assert torch.equal(target, want)


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (37, 256, 8), (500, 256, 8), (33, 257, 3), (9, 30000, 4), (5, 2, 2)])
def test_sort_by_expert_on_narrow_keys_is_the_int64_sort(T, E, k):
    """sort_by_expert sorts uint8 or int16 keys where they hold every expert: the same stable order (ties in pair
    order), tokens and run ends as a sort of the int64 ids, at expert counts on each side of a byte's 256."""
    from deltaserve.kernels.moe.experts import sort_by_expert, sort_key_dtype

    gen = torch.Generator().manual_seed(T * E + k)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    ids[::3] = ids[0].clone()  # repeated rows: many ties
    order, token, ends = sort_by_expert(ids, E)
    flat = ids.flatten()
    expected = flat.argsort(stable=True)
    assert torch.equal(order, expected) and torch.equal(token, expected // k)
    assert torch.equal(ends, torch.bincount(flat, minlength=E).cumsum(0))
    assert sort_key_dtype(E) == (torch.uint8 if E <= 256 else torch.int16)
