"""Our Triton kernels against their twins on the CPU, through Triton's interpreter (TRITON_INTERPRET=1), so CI
checks them without a GPU. On a machine with CUDA, tests/gpu runs the same kernels compiled instead."""

import pytest
import torch
import triton
from helpers.kernels import (
    PagedLatents,
    mostly_equal,
    norm_gemv_inputs,
    norm_inputs,
    rel_err,
    require_triton_interpreter,
    within_ulps,
)

require_triton_interpreter()

from deltaserve.kernels import triton_norm  # noqa: E402
from deltaserve.kernels.activation import silu_and_mul  # noqa: E402
from deltaserve.kernels.conv1d import causal_conv1d_varlen, conv_states_at  # noqa: E402
from deltaserve.kernels.conv1d_triton import conv1d_states_at, conv1d_update, conv1d_varlen  # noqa: E402
from deltaserve.kernels.gemv import GEMV_TILES, gemv  # noqa: E402
from deltaserve.kernels.kda import fused_recurrent_kda, kda_gate, kda_prefill, l2norm  # noqa: E402
from deltaserve.kernels.kda.naive import naive_causal_conv1d  # noqa: E402
from deltaserve.kernels.kda.triton_decode import kda_decode, kda_recurrent_varlen  # noqa: E402
from deltaserve.kernels.mla import triton_decode  # noqa: E402
from deltaserve.kernels.mla.attention import torch_mla_decode  # noqa: E402
from deltaserve.kernels.mla.keys import expand_keys  # noqa: E402
from deltaserve.kernels.mla.triton_decode import (  # noqa: E402
    MERGE_MIN_COLS,
    MERGE_PROGRAMS,
    MERGE_TILE,
    WIDE_FROM,
    merge_tiles,
    triton_mla_decode,
)
from deltaserve.kernels.mla.triton_keys import triton_expand_keys  # noqa: E402
from deltaserve.kernels.moe.experts import _weighted_sum  # noqa: E402
from deltaserve.kernels.moe.naive import naive_experts, naive_grouped_topk  # noqa: E402
from deltaserve.kernels.moe.triton_blocks import SORT_CHUNK, block_experts, expert_blocks, torch_expert_blocks  # noqa: E402
from deltaserve.kernels.moe.triton_combine import weighted_sum  # noqa: E402
from deltaserve.kernels.moe.triton_decode import _sum_slots, decode_experts  # noqa: E402
from deltaserve.kernels.moe.triton_routing import _ROUTER_TILES, router_logits, triton_topk  # noqa: E402
from deltaserve.kernels.norm import add_rms_norm, gated_rms_norm, rms_norm  # noqa: E402
from deltaserve.kernels.norm_gemv import add_norm_gemv, gated_norm_gemv, naive_add_norm_linear, naive_gated_norm_linear  # noqa: E402
from deltaserve.kernels.triton_activation import triton_silu_and_mul  # noqa: E402
from deltaserve.kernels.triton_copy import triton_copy_rows, triton_gather_rows  # noqa: E402
from deltaserve.kernels.varlen import pack_seqs  # noqa: E402


@pytest.mark.parametrize("B,H,K", [(1, 2, 16), (3, 4, 32), (5, 1, 64), (2, 4, 48)])  # 48: the demo model's
def test_kda_decode_kernel_matches_twin(B, H, K):
    gen = torch.Generator().manual_seed(B * K)
    S = B + 3
    qkv = torch.randn(B, 3, H, K, generator=gen)
    g_raw, b_raw = torch.randn(B, H * K, generator=gen), torch.randn(B, H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen) * 2 - 3
    a_log = torch.empty(H).uniform_(1, 16, generator=gen).log()
    state = torch.randn(S, H, K, K, generator=gen) * 0.1
    slots = torch.randperm(S, generator=gen)[:B]
    unused = torch.ones(S, dtype=torch.bool)
    unused[slots] = False
    state[unused] = 1e30
    twin_state = state.clone()
    o = kda_decode(qkv[:, 0], qkv[:, 1], qkv[:, 2], g_raw, b_raw, dt_bias, a_log, state, slots, K ** -0.5)
    o_twin = fused_recurrent_kda(l2norm(qkv[:, 0]), l2norm(qkv[:, 1]), qkv[:, 2], kda_gate(g_raw, dt_bias, a_log),
                                 torch.sigmoid(b_raw), K ** -0.5, twin_state, slots)
    assert rel_err(o, o_twin) < 1e-5
    assert rel_err(state[slots], twin_state[slots]) < 1e-5
    assert torch.all(state[unused] == 1e30)


@pytest.mark.parametrize("lengths,H,K,dtype", [([1], 2, 16, torch.float32), ([5, 1, 17], 4, 32, torch.float32),
                                               ([64, 3], 1, 48, torch.float32), ([2, 9], 2, 64, torch.float32),
                                               ([3, 0, 2], 2, 16, torch.float32), ([4, 7], 2, 32, torch.bfloat16)])
def test_kda_recurrent_varlen_kernel_matches_the_chunked_twin(lengths, H, K, dtype):
    """A short prefill's recurrent kernel (each program walks its sequence's tokens) against the CPU's chunked
    path, at ragged lengths (an empty sequence among them) from pooled states in shuffled slots; other slots
    untouched; the output in v's dtype."""
    gen = torch.Generator().manual_seed(sum(lengths) * K)
    N, S = sum(lengths), len(lengths) + 3
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    qkv = torch.randn(N, 3, H, K, generator=gen).to(dtype)
    g_raw, b_raw = torch.randn(N, H * K, generator=gen).to(dtype), torch.randn(N, H, generator=gen).to(dtype)
    dt_bias = torch.randn(H * K, generator=gen) * 2 - 3
    a_log = torch.empty(H).uniform_(1, 16, generator=gen).log()
    state = torch.randn(S, H, K, K, generator=gen) * 0.1
    slots = torch.randperm(S, generator=gen)[: len(lengths)].tolist()
    unused = torch.ones(S, dtype=torch.bool)
    unused[slots] = False
    state[unused] = 1e30
    twin_state = state.clone()
    args = (dt_bias, a_log)
    o = kda_recurrent_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], g_raw, b_raw, *args, state,
                             pack_seqs(slots, cu, torch.device("cpu")), K ** -0.5)
    b_twin = b_raw.float()  # the kernel's sigmoid is float32's
    o_twin = kda_prefill(qkv[:, 0].float(), qkv[:, 1].float(), qkv[:, 2].float(), g_raw.float(), b_twin, *args,
                         twin_state, slots, cu, K ** -0.5)
    assert o.dtype == dtype  # rounded once in the kernel: bf16's 2^-9 at most
    assert rel_err(o, o_twin) < (1e-5 if dtype == torch.float32 else 4e-3)
    assert rel_err(state[slots], twin_state[slots]) < 1e-5
    assert torch.all(state[unused] == 1e30)


@pytest.mark.parametrize("B,C,W", [(1, 7, 4), (4, 300, 4), (2, 33, 2)])
def test_conv_update_kernel_matches_naive(B, C, W):
    gen = torch.Generator().manual_seed(B * C)
    x = torch.randn(B, 2 * C, generator=gen)[:, :C]  # strided rows, as a split of in_proj's output
    weight = torch.randn(C, W, generator=gen)
    state = torch.randn(B + 2, C, W - 1, generator=gen)
    slots = torch.randperm(B + 2, generator=gen)[:B]
    before = state.clone()
    y = conv1d_update(x, weight, state, slots)
    for b, slot in enumerate(slots.tolist()):
        y_ref, state_ref = naive_causal_conv1d(x[b:b + 1], weight, before[slot])
        assert rel_err(y[b:b + 1], y_ref) < 1e-5
        assert torch.equal(state[slot], state_ref)


@pytest.mark.parametrize("W,lengths", [(4, [1, 2, 3, 4, 5, 70]), (2, [1, 33]), (3, [40, 1, 2])])
def test_conv_varlen_kernels_match_naive(W, lengths):
    """Packed sequences shorter than, as long as and longer than the kernel (and than a tile of tokens), from strided
    rows, each continuing its own state slot given out of order; the other slots untouched. The interpreter runs a
    program's threads as one, so the state kernel's in-place update is checked for races on a GPU only
    (tests/gpu/test_gpu_kernels.py, sequences shorter than the kernel)."""
    gen = torch.Generator().manual_seed(W * sum(lengths))
    C, S = 300, len(lengths) + 2
    cu = torch.tensor([0] + lengths).cumsum(0).tolist()
    x = torch.randn(cu[-1], 2 * C, generator=gen)[:, :C]
    weight = torch.randn(C, W, generator=gen)
    state = torch.randn(S, C, W - 1, generator=gen)
    slots = torch.randperm(S, generator=gen)[:len(lengths)]
    before = state.clone()
    y = conv1d_varlen(x, weight, state, pack_seqs(slots.tolist(), cu, torch.device("cpu")))
    for b, slot in enumerate(slots.tolist()):
        y_ref, state_ref = naive_causal_conv1d(x[cu[b]:cu[b + 1]], weight, before[slot])
        assert rel_err(y[cu[b]:cu[b + 1]], y_ref) < 1e-5
        assert torch.equal(state[slot], state_ref)
    others = [s for s in range(S) if s not in slots.tolist()]
    assert torch.equal(state[others], before[others])


@pytest.mark.parametrize("groups,C", [(3, 3 * 40), (2, 2 * 130), (3, 3 * 128)])  # 128: a program's block a group's
@pytest.mark.parametrize("interior", [True, False])
def test_conv_varlen_kernel_stores_channel_groups_apart(groups, C, interior):
    """groups > 1 (KDA's q, k and v): the twin's values, each group's [N, C / groups] contiguous, and the states
    as with one group; tiles past a sequence's first through the interior path or the general one alike."""
    gen = torch.Generator().manual_seed(C)
    lengths, W = [3, 40, 1], 4
    cu = torch.tensor([0] + lengths).cumsum(0).tolist()
    x = torch.randn(cu[-1], C + 5, generator=gen)[:, :C]
    weight = torch.randn(C, W, generator=gen)
    state = torch.randn(5, C, W - 1, generator=gen)
    twin_state = state.clone()
    y = conv1d_varlen(x, weight, state, pack_seqs([4, 0, 2], cu, torch.device("cpu")), groups, interior)
    want = causal_conv1d_varlen(x, weight, twin_state, [4, 0, 2], cu, groups=groups)  # a CPU tensor: the twin
    assert y.shape == (cu[-1], groups, C // groups) and all(y[:, g].is_contiguous() for g in range(groups))
    assert rel_err(y, want) < 1e-5 and torch.equal(state, twin_state)


@pytest.mark.parametrize("W", [4, 2])
def test_conv_states_at_kernel_matches_twin(W):
    """Conv states partway through sequences into snapshot slots, as the torch twin writes them: a cut before the
    first token (the old state whole), cuts shorter than the kernel (part old state, part inputs), longer ones;
    the states themselves and the other snapshot slots untouched."""
    gen = torch.Generator().manual_seed(W)
    C, N = 300, 60
    x = torch.randn(N, C + 7, generator=gen)[:, :C]
    state, snapshots = torch.randn(6, C, W - 1, generator=gen), torch.randn(5, C, W - 1, generator=gen)
    slots, snapshot_slots = torch.tensor([5, 1, 3, 0]), torch.tensor([2, 4, 0, 1])
    starts, ends = torch.tensor([0, 10, 20, 50]), torch.tensor([0, 11, 40, 52])
    before, want = state.clone(), snapshots.clone()
    conv_states_at(x, state, want, slots, snapshot_slots, starts, ends)  # CPU tensors: the twin
    conv1d_states_at(x, state, snapshots, slots, snapshot_slots, starts, ends)
    assert torch.equal(snapshots, want) and torch.equal(state, before)
    assert torch.equal(snapshots[2], state[5]) and torch.equal(snapshots[0][:, -1], x[39])


def test_conv_varlen_kernels_with_no_tokens_leave_the_states():
    """A step with no prefill tokens: an empty output, every state slot as it was."""
    state = torch.randn(3, 8, 3, generator=torch.Generator().manual_seed(1))
    before = state.clone()
    y = conv1d_varlen(torch.empty(0, 8), torch.randn(8, 4), state, pack_seqs([], [0], torch.device("cpu")))
    assert y.shape == (0, 8) and torch.equal(state, before)


@pytest.mark.parametrize("T,k,D", [(1, 2, 40), (7, 8, 600), (33, 4, 512)])
def test_weighted_sum_kernel_matches_twin(T, k, D):
    """The grouped path's combine: sorted outputs back to their tokens, weighted and summed (D ragged against the
    kernel's column tile); the same with the pairs' rows given."""
    gen = torch.Generator().manual_seed(T * k)
    ids = torch.randint(0, 16, (T, k), generator=gen)
    order = ids.flatten().argsort(stable=True)
    y = torch.randn(T * k, D, generator=gen).to(torch.bfloat16)
    weights = torch.rand(T, k, generator=gen)
    got = weighted_sum(y, order, weights, torch.float32)
    assert rel_err(got, _weighted_sum(y, order, weights, torch.float32)) < 1e-6
    where = order.argsort()  # each pair's row, as expert_blocks hands it over
    assert torch.equal(weighted_sum(y, order, weights, torch.float32, where), got)


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
    ([37, 130], 4, 32, 16, 6, None),  # a page size not a power of two: every token's page looked up
    ([100, 9], 16, 32, 16, 64, 3),  # pages longer than an inner step: one page holds several tiles
])
@pytest.mark.parametrize("min_split,max_head_block,block_n", [(256, 32, 32), (32, 16, 32), (33, 32, 16),
                                                               (64, None, 32), (16, 16, 64)])
def test_mla_decode_kernel_matches_torch_twin(lengths, H, R, DR, page, width, min_split, max_head_block, block_n):
    """Paged, split-context MLA decode against the torch path (gather every page, masked softmax); slices of at
    least min_split tokens (a context of one slice, of many, of slices past its end), heads one or more blocks,
    block_n context tokens an inner step (a slice rounds up to whole steps)."""
    gen = torch.Generator().manual_seed(sum(lengths) * H)
    paged = PagedLatents(lengths, R + DR, page, 64, gen)
    tables = paged.block_tables(width)
    B = len(lengths)
    q_latent = torch.randn(H, B, R, generator=gen).transpose(0, 1)  # strided rows, as the absorbed query's
    q_rope = torch.randn(B, H, 2 * DR, generator=gen)[..., DR:]
    lens = torch.tensor(lengths)
    twin = torch_mla_decode(q_latent, q_rope, paged.cache, tables, lens, 0.3)
    out = triton_mla_decode(q_latent, q_rope, paged.cache, tables, lens, 0.3, min_split, max_head_block,
                            block_n=block_n)
    assert rel_err(out, twin) < 1e-5


@pytest.mark.parametrize("lengths,H,wide_from,width", [
    ([5, 1, 700, 333], 20, 300, None),  # two head blocks, the second ragged: 700 and 333 wide, 5 and 1 not
    ([900], 32, 1, None),  # one sequence, every head in each program
    ([64, 65], 32, 65, 128),  # the threshold between two contexts; a table wider than both
])
@pytest.mark.parametrize("splits", [None, 3])  # 3: a wide context uses all 6 slices, past a head block's 3
def test_mla_decode_wide_mode_matches_the_twin(lengths, H, wide_from, width, splits):
    """wide_from: a sequence of that many context tokens or more is attended by each program with all heads over its
    own slice (head blocks x slices of them); shorter ones by head block, as without it. Same output as the twin."""
    gen = torch.Generator().manual_seed(sum(lengths) + H)
    assert _decode_against_twin(lengths, H, 32, 16, 128, gen, width, min_split=32, max_head_block=16, splits=splits,
                                wide_from=wide_from) < 1e-5


@pytest.mark.parametrize("H,table_tokens,wide_h", [(32, WIDE_FROM - 16, 0), (32, WIDE_FROM, 32), (16, WIDE_FROM, 0)])
def test_mla_decode_wide_path_compiled_in_only_where_it_can_run(monkeypatch, H, table_tokens, wide_h):
    """By default (WIDE_FROM), the all-heads path is compiled into the split kernel only where a sequence can reach
    it: the block table holds WIDE_FROM tokens and the heads make more than one head block. Elsewhere it would cost
    the 16-head path registers for nothing."""
    class Launched(Exception):
        pass

    class Spy:  # the launch's grid, then its arguments: records WIDE_H and stops
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise Launched(kwargs["WIDE_H"])
            return launch

    monkeypatch.setattr(triton_decode, "_mla_decode_split_kernel", Spy())
    tables = torch.zeros(1, table_tokens // 16, dtype=torch.int64)
    with pytest.raises(Launched) as launched:
        triton_mla_decode(torch.randn(1, H, 32), torch.randn(1, H, 16), torch.zeros(1, 16, 48), tables,
                          torch.tensor([1]), 0.3)
    assert launched.value.args == (wide_h,)


@pytest.mark.parametrize("batches", [(1,), (3, 4), (5, 8)])
def test_mla_decode_merge_launch_follows_the_batchs_power_of_two_not_the_table_width(monkeypatch, batches):
    """An eager decode beside a prompt meets any block-table width and batch: the merge kernel's constants (slices a
    step, columns a program) follow the batch's power of two alone, so one compiled variant serves every width the
    warm-up's batches of that power did not meet (a GPU test found a variant built while serving: BENCHMARKS.md,
    stop 53). The outputs still match the twin."""
    launches, merge = [], triton_decode._mla_decode_merge_kernel

    class Spy:  # records the merge's constants, then launches it
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((kwargs["SLICES"], kwargs["BR"]))
                return merge[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_decode, "_mla_decode_merge_kernel", Spy())
    gen = torch.Generator().manual_seed(len(batches))
    for B in batches:
        for width in (1, 3, 13, 16):  # pages of 16 tokens
            lengths = [1 + (7 * i + width * 11) % (16 * width) for i in range(B)]
            assert _decode_against_twin(lengths, 4, 32, 8, B * width + 1, gen, width=width, min_split=16) < 1e-5
    assert len(set(launches)) == 1, launches


def _decode_against_twin(lengths, H, R, DR, num_pages, gen, width=None, **knobs) -> float:
    """rel_err of triton_mla_decode (with knobs) against the twin: random latents of sequences of `lengths` in pages of
    16, block tables `width` pages wide (default: the longest's)."""
    paged = PagedLatents(lengths, R + DR, 16, num_pages, gen)
    tables = paged.block_tables(width)
    q_latent = torch.randn(len(lengths), H, R, generator=gen)
    q_rope = torch.randn(len(lengths), H, DR, generator=gen)
    lens = torch.tensor(lengths)
    twin = torch_mla_decode(q_latent, q_rope, paged.cache, tables, lens, 0.3)
    return rel_err(triton_mla_decode(q_latent, q_rope, paged.cache, tables, lens, 0.3, **knobs), twin)


@pytest.mark.parametrize("merge_slices,merge_cols", [(None, None), (1, None), (4, 16), (16, 8), (2, 64)])
def test_mla_decode_merge_kernel_variants_match_the_twin(merge_slices, merge_cols):
    """The merge kernel weighing several slices a step (a count of slices not a multiple of it, a context of one
    slice) over column blocks of the latent (R not a multiple of the block: a masked tail); None: merge_tiles'."""
    gen = torch.Generator().manual_seed((merge_slices or 0) * 7 + (merge_cols or 0))
    assert _decode_against_twin([1, 70, 333, 40], 4, 20, 8, 32, gen, min_split=16, merge_slices=merge_slices,
                                merge_cols=merge_cols) < 1e-5
    with pytest.raises(ValueError, match="power of two"):
        _decode_against_twin([1], 4, 20, 8, 4, gen, merge_slices=3)


@pytest.mark.parametrize("B,splits", [(1, 132), (1, 2), (3, 44), (16, 9), (64, 3), (256, 1), (1000, 1)])
def test_mla_decode_merge_tiles_fill_the_gpu_or_take_whole_rows(B, splits):
    """The 48B shape (32 heads, R 512): a batch of few rows splits the columns until MERGE_PROGRAMS programs or
    MERGE_MIN_COLS columns a program; a large one keeps whole rows. Tiles are powers of two within MERGE_TILE, with
    no more slices a step than the launch has."""
    rows, R = B * 32, 512
    slices, cols = merge_tiles(rows, R, splits)
    programs = rows * -(-R // cols)
    assert programs >= MERGE_PROGRAMS or cols == MERGE_MIN_COLS
    assert cols == R or programs < 2 * MERGE_PROGRAMS  # no more columns split than filling the GPU needs
    assert slices & (slices - 1) == 0 and cols & (cols - 1) == 0 and slices * cols <= max(MERGE_TILE, cols)
    assert slices <= triton.next_power_of_2(splits)
    chosen = {(1, 132): (128, 32), (64, 3): (4, 512), (256, 1): (1, 512)}  # the launches mla_decode_ab timed
    assert (slices, cols) == chosen.get((B, splits), (slices, cols))


@pytest.mark.parametrize("tile", [None, *_ROUTER_TILES])  # None: the (interpreter's one) autotuned config
@pytest.mark.parametrize("T,E,D", [(1, 256, 2304), (3, 10, 100)])
def test_router_logits_kernel_matches_float32_linear(T, E, D, tile):
    """bf16 activations (a strided view, as a split leaves them) against float32 weights, widened in the kernel."""
    gen = torch.Generator().manual_seed(T * E)
    x = torch.randn(T, 2 * D, generator=gen).bfloat16()[:, :D]
    weight = torch.randn(E, D, generator=gen) * 0.05
    assert rel_err(router_logits(x, weight, tile), torch.nn.functional.linear(x.float(), weight)) < 1e-6


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


# The interpreter rounds float32 to bf16 by truncation where the GPU rounds to nearest even, so the kernel's bf16 values
# (the residual stream, the normalised input) may sit one unit in the last place off the twin's here, and the
# products by the few percent that biased roundings add up to; tests/gpu checks the compiled kernels tighter.
# (3, 1100, 96): the router's case (float32 weights, the norm over several K tiles, ragged against both tiles) at a
# width the interpreter runs in seconds; tests/gpu runs the 48B's 2304 x 256
@pytest.mark.parametrize("tile", [None, (4, 1024), (64, 128)])
@pytest.mark.parametrize("T,D,N,weight_dtype", [(1, 300, 70, torch.bfloat16), (3, 1100, 96, torch.float32),
                                                (2, 100, 10, torch.float32)])
def test_add_norm_gemv_matches_norm_then_linear(T, D, N, weight_dtype, tile):
    case = norm_gemv_inputs(T, D, N, weight_dtype, seed=T * D + N)
    args = case["x"], case["residual"], case["norm_weight"], case["eps"], case["weight"]
    y, s, h = add_norm_gemv(*args, store_normed=True, tile=tile)
    y_twin, s_twin, h_twin = naive_add_norm_linear(*args)
    assert y.dtype == weight_dtype and y.shape == (T, N) and s.shape == h.shape == (T, D)
    assert within_ulps(s, s_twin) and within_ulps(h, h_twin, ulps=4)  # three truncations: s, normed, h
    assert rel_err(y, y_twin) < 2e-2
    assert add_norm_gemv(*args)[2] is None  # h stored only when asked for


@pytest.mark.parametrize("tile", [None, (8, 256), (4, 1024)])
@pytest.mark.parametrize("T,H,K,N", [(1, 4, 128, 70), (2, 3, 64, 129), (1, 5, 16, 33)])
def test_gated_norm_gemv_matches_gated_norm_then_linear(T, H, K, N, tile):
    """Heads of 128, 64 and 16 (a column tile holds several), ragged head counts and rows, a strided gate."""
    case = norm_gemv_inputs(T, K, N, torch.bfloat16, seed=T * H + N, gated_heads=H)
    args = case["o"], case["gate"], case["norm_weight"], case["eps"], case["weight"]
    y = gated_norm_gemv(*args, tile=tile)
    assert y.dtype == torch.bfloat16 and y.shape == (T, N)
    assert rel_err(y, naive_gated_norm_linear(*args)) < 2e-2


@pytest.mark.parametrize("T,D,N,block", [(1, 64, 70, (128, 128)), (2, 300, 129, (128, 128)), (1, 256, 200, (64, 32))])
def test_norm_gemv_kernels_read_fp8_weights_as_their_twins(T, D, N, block):
    """FP8 weights with their block scales, blocks wider than the weight (the tiny model's 64-wide hidden) or ragged
    against the tiles; gated with heads of 16 and 64."""
    from deltaserve.kernels.quant.fp8 import quantize_fp8

    case = norm_gemv_inputs(T, D, N, torch.bfloat16, seed=T * D + N)
    q, scale_inv = quantize_fp8(case["weight"].float(), block)
    args = case["x"], case["residual"], case["norm_weight"], case["eps"], q
    y = add_norm_gemv(*args, scale_inv=scale_inv, block=block)[0]
    assert rel_err(y, naive_add_norm_linear(*args, scale_inv=scale_inv, block=block)[0]) < 2e-2
    H, K = (4, 16) if D < 128 else (3, 64)
    gated = norm_gemv_inputs(T, K, N, torch.bfloat16, seed=N, gated_heads=H)
    q, scale_inv = quantize_fp8(gated["weight"].float(), block)
    args = gated["o"], gated["gate"], gated["norm_weight"], gated["eps"], q
    y = gated_norm_gemv(*args, scale_inv=scale_inv, block=block)
    assert rel_err(y, naive_gated_norm_linear(*args, scale_inv=scale_inv, block=block)) < 2e-2


def test_norm_gemv_wrappers_refuse_inputs_of_another_dtype():
    """The kernels read every input in x's (o's) dtype: a float32 residual, norm weight or gate is refused by name,
    not rounded silently (the layers' fits() sends such steps down the unfused path)."""
    case = norm_gemv_inputs(1, 64, 8, torch.bfloat16, seed=1)
    args = case["x"], case["residual"], case["norm_weight"], case["eps"], case["weight"]
    for i in (1, 2):  # the residual, the norm weight
        bad = list(args)
        bad[i] = bad[i].float()
        with pytest.raises(AssertionError, match="share one dtype"):
            add_norm_gemv(*bad)
    gated = norm_gemv_inputs(1, 16, 8, torch.bfloat16, seed=2, gated_heads=2)
    with pytest.raises(AssertionError, match="share one dtype"):
        gated_norm_gemv(gated["o"], gated["gate"].float(), gated["norm_weight"], gated["eps"], gated["weight"])


@pytest.mark.parametrize("lazy_slack", [0.0, 2.0, 8.0])
def test_mla_decode_kernel_rescales_as_scores_rise(lazy_slack):
    """Scores that rise along the context (each latent scaled up with its position): a head's running max moves
    many times, by less and by more than the slack, and the output stays the twin's."""
    gen = torch.Generator().manual_seed(11)
    lengths, H, R, DR, page = [300, 77], 16, 32, 16, 8
    paged = PagedLatents(lengths, R + DR, page, 64, gen)
    for n, pages in zip(lengths, paged.tables):
        for pos, scale in enumerate(torch.linspace(0.05, 3.0, n).tolist()):
            paged.cache[pages[pos // page], pos % page] *= scale
    tables = paged.block_tables()
    q_latent = 2 * torch.randn(len(lengths), H, R, generator=gen)
    q_rope = 2 * torch.randn(len(lengths), H, DR, generator=gen)
    lens = torch.tensor(lengths)
    twin = torch_mla_decode(q_latent, q_rope, paged.cache, tables, lens, 0.3)
    out = triton_mla_decode(q_latent, q_rope, paged.cache, tables, lens, 0.3, min_split=128, block_n=16,
                            lazy_slack=lazy_slack)
    assert rel_err(out, twin) < 1e-5


@pytest.mark.parametrize("reread_tile", [False, True])
def test_mla_decode_kernel_reads_a_float8_cache_as_its_twin_does(reread_tile):
    """A float8_e4m3fn latent cache (--kv-cache-dtype fp8): the kernel widens each tile as it reads it (once, or
    once for each product), the torch twin the gathered pages; float32 queries (bf16 ones: tests/gpu)."""
    gen = torch.Generator().manual_seed(8)
    lengths, H, R, DR, page = [37, 1, 90], 8, 64, 16, 8
    paged = PagedLatents(lengths, R + DR, page, 40, gen, dtype=torch.float8_e4m3fn)
    tables = paged.block_tables(16)
    q_latent = torch.randn(len(lengths), H, R, generator=gen)
    q_rope = torch.randn(len(lengths), H, DR, generator=gen)
    lens = torch.tensor(lengths)
    twin = torch_mla_decode(q_latent, q_rope, paged.cache, tables, lens, 0.3)
    out = triton_mla_decode(q_latent, q_rope, paged.cache, tables, lens, 0.3, reread_tile=reread_tile)
    assert out.dtype == torch.float32 and rel_err(out, twin) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2304), (5, 512), (3, 2, 300), (7, 3, 128), (0, 64)])
def test_norm_kernels_match_their_eager_twins(shape, dtype):
    """rms_norm, add_rms_norm and gated_rms_norm (kernels.triton_norm, the GPU's) against kernels.norm's eager
    functions: ragged widths (300: a masked tail), extra leading dimensions, no rows, strided x, residual and gate.
    float16 (the interpreter rounds it to nearest, as a GPU does) all but a few elements bit for bit, so a missing or
    extra rounding shows; bfloat16 within a unit in the last place a rounding (the interpreter's bfloat16 cast
    truncates; tests/gpu checks the compiled kernels); float32 within 1e-6."""
    case = norm_inputs(shape, dtype, seed=sum(shape))
    x, residual, gate, weight, eps = case["x"], case["residual"], case["gate"], case["weight"], case["eps"]

    def close(a, b, roundings):
        if dtype == torch.float16:
            return mostly_equal(a, b)
        if dtype == torch.bfloat16:
            return within_ulps(a, b, ulps=roundings)
        return a.numel() == 0 or rel_err(a, b) < 1e-6

    got = triton_norm.rms_norm(x, weight, eps)
    assert got.shape == x.shape and got.dtype == dtype and close(got, rms_norm.eager(x, weight, eps), 2)
    normed, total = triton_norm.add_rms_norm(x, residual, weight, eps)
    normed_twin, total_twin = add_rms_norm.eager(x, residual, weight, eps)
    assert close(total, total_twin, 1) and close(normed, normed_twin, 4)  # the sum, normalised, scaled: 3 roundings
    for w in (weight, case["weight32"]):  # KDA's weight in the model's dtype; a float32 one it must not round
        got = triton_norm.gated_rms_norm(x, gate, w, eps)
        assert got.dtype == dtype and close(got, gated_rms_norm.eager(x, gate, w, eps), 1)


def test_norms_take_the_triton_kernels_on_a_gpu_tensor_only_where_the_dtypes_agree(monkeypatch):
    """The dispatch of kernels.norm: a CUDA tensor goes to kernels.triton_norm (stood in for here: this machine has
    no GPU), except rms_norm and add_rms_norm with a weight of another dtype (their eager product rounds once in the
    wider dtype, which the kernel does not); a CPU tensor runs the eager function."""
    calls = []
    for name in ("rms_norm", "add_rms_norm", "gated_rms_norm"):
        monkeypatch.setattr(triton_norm, name, lambda *args, name=name: calls.append(name) or "kernel")
    cuda_like = torch.ones(2, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t is cuda_like))
    w_bf16, w_f32 = torch.ones(8, dtype=torch.bfloat16), torch.ones(8)
    assert rms_norm(cuda_like, w_bf16, 1e-6) == "kernel" and gated_rms_norm(cuda_like, w_f32, w_f32, 1e-6) == "kernel"
    assert add_rms_norm(cuda_like, cuda_like, w_bf16, 1e-6) == "kernel"
    assert isinstance(rms_norm(cuda_like, w_f32, 1e-6), torch.Tensor)  # mixed dtypes: eager
    assert isinstance(rms_norm(torch.ones(2, 8), w_f32, 1e-6), torch.Tensor)
    assert calls == ["rms_norm", "gated_rms_norm", "add_rms_norm"]


@pytest.mark.parametrize("T,slots,D", [(1, 9, 2304), (4, 3, 700), (0, 2, 64)])
def test_slot_sum_kernel_matches_torch_sum(T, slots, D):
    """The decode experts' last launch: each token's slots summed in float32 in slot order (y.sum(1)'s), rounded
    (the interpreter's bfloat16 cast truncates: one unit in the last place; tests/gpu checks the compiled one)."""
    y = torch.randn(T, slots, D, generator=torch.Generator().manual_seed(T + D))
    assert torch.equal(_sum_slots(y, torch.float32), y.sum(1))
    assert within_ulps(_sum_slots(y, torch.bfloat16), y.sum(1).to(torch.bfloat16))


@pytest.mark.parametrize("T,E,k,D,I,tiles", [
    (1, 8, 2, 48, 40, ((64, 128), (64, 128))),  # one token: blocks of one row
    (5, 16, 4, 100, 72, ((16, 32), (32, 16))),  # reductions over several ragged steps
    (40, 4, 2, 64, 32, ((32, 64), (16, 64))),  # 20 rows an expert: two blocks each, the second partial
])
def test_block_experts_match_naive(T, E, k, D, I, tiles):
    """Pairs sorted by expert in blocks of 16 rows, each block's expert read once per tile, against the per-pair
    spec, at ragged widths and with experts that no token chose."""
    gen = torch.Generator().manual_seed(T * E + D)
    x = torch.randn(T, D, generator=gen)
    w13, w2 = torch.randn(E, 2 * I, D, generator=gen) * 0.1, torch.randn(E, D, I, generator=gen) * 0.1
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    ids[ids == E - 1] = 0  # the last expert unchosen: a block table entry past the experts that were
    weights = torch.rand(T, k, generator=gen)
    out = block_experts(x, w13, w2, weights, ids, *tiles)
    assert rel_err(out, naive_experts(x, w13, w2, weights, ids)) < 1e-5


@pytest.mark.parametrize("T,E,k,skew", [
    (1, 8, 2, False), (5, 16, 4, False), (33, 7, 3, False), (64, 256, 8, False), (37, 12, 4, True), (200, 64, 6, True),
])
def test_expert_blocks_kernel_matches_twin(T, E, k, skew):
    """The pairs placed into expert blocks, a program a chunk, against torch_expert_blocks, every output equal (the
    blocks past the last too), at ragged pair counts, chunks of 8 and of the default (a partial last chunk),
    experts that no token chose, and (skew) a few experts with many blocks each."""
    gen = torch.Generator().manual_seed(T * E + k)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    if skew:
        ids = torch.stack([torch.randperm(k + 1, generator=gen)[:k] for _ in range(T)])  # k + 1 of E experts
    want = torch_expert_blocks(ids, E)
    for chunk in (8, SORT_CHUNK):
        for got, expected in zip(expert_blocks(ids, E, chunk=chunk), want):
            assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("T,E,k,chunk", [(3, 1, 1, 32), (6, 5, 4, 8), (512, 256, 8, 512)])
def test_expert_blocks_kernel_at_the_edges(T, E, k, chunk):
    """One expert only; a token choosing the same expert twice (the pairs still in place, in order); and the most
    pairs the kernel takes (MOST_SORTED_PAIRS), each against the twin."""
    gen = torch.Generator().manual_seed(T + E)
    ids = torch.randint(0, E, (T, k), generator=gen)
    for got, want in zip(expert_blocks(ids, E, chunk=chunk), torch_expert_blocks(ids, E)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("L,S,shape,pairs", [(1, 4, (3, 5), [(0, 2)]), (3, 6, (2, 3000), [(5, 0), (1, 3), (2, 2)]),
                                             (2, 5, (4097,), [(4, 1), (0, 4)])])
def test_copy_rows_kernel_matches_twin(L, S, shape, pairs):
    """Whole rows of [L, S, ...] copied slot to slot in every layer, as the torch twin copies them, at row lengths
    around the kernel's block; the rows not named stay."""
    from deltaserve.kernels.cache_ops import copy_rows

    gen = torch.Generator().manual_seed(L * S)
    source, target = torch.randn(L, S, *shape, generator=gen), torch.randn(L, S + 1, *shape, generator=gen)
    src, dst = (torch.tensor(side) for side in zip(*pairs))
    want = target.clone()
    copy_rows(source, want, src, dst)  # a CPU tensor: the twin
    triton_copy_rows(source, target, src, dst)
    assert torch.equal(target, want)
    assert all(torch.equal(want[:, d], source[:, s]) for s, d in pairs)


def test_copy_rows_kernel_refuses_what_it_cannot_address():
    """int32 slot indices (a slot's offset overflows past 2**31 elements) and rows of two dtypes are refused with
    what was passed; copy_rows itself widens the indices."""
    source, target = torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="int64 indices"):
        triton_copy_rows(source, target, torch.tensor([1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="torch.float16"):
        triton_copy_rows(source, target.half(), torch.tensor([1]), torch.tensor([2]))


def test_block_experts_with_no_tokens():
    x = torch.randn(0, 16)
    out = block_experts(x, torch.randn(4, 8, 16), torch.randn(4, 16, 4), torch.rand(0, 2),
                        torch.zeros(0, 2, dtype=torch.long))
    assert out.shape == (0, 16)


@pytest.mark.parametrize("M,I", [(1, 8), (7, 1000), (3, 1500), (0, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_kernel_matches_twin(M, I, dtype):
    """SwiGLU's activation from strided rows (a column slice of a wider tensor), at widths around the kernel's
    block: rounded once from float32, so within an ulp of the float32 product and two of the torch twin's two
    roundings; the output contiguous."""
    gen = torch.Generator().manual_seed(M * I)
    x = (torch.randn(M, 2 * I + 6, generator=gen) * 4).to(dtype)[:, : 2 * I]
    y = triton_silu_and_mul(x)
    gate, up = x.float().chunk(2, dim=-1)
    assert y.dtype == dtype and y.shape == (M, I) and y.is_contiguous()
    assert within_ulps(y, (torch.nn.functional.silu(gate) * up).to(dtype), 1)
    assert within_ulps(y, silu_and_mul(x), 2)  # a CPU tensor: the twin


@pytest.mark.parametrize("L,H,DN,DR", [(1, 1, 8, 4), (5, 3, 16, 8), (37, 32, 128, 64), (9, 20, 24, 12)])
def test_expand_keys_kernel_matches_twin(L, H, DN, DR):
    """MLA's prefill keys from kv_b_proj's output as the layer views it (k_nope: each head's first DN of DN + DV
    columns) and the latents' k_rope columns (strided rows), at head counts and widths off the kernel's blocks: the
    twin's torch.cat bit for bit, contiguous."""
    gen = torch.Generator().manual_seed(L * H + DN)
    DV, R = DN + 3, 2 * DN
    kv = torch.randn(L, H, DN + DV, generator=gen).bfloat16()
    latents = torch.randn(L, R + DR, generator=gen).bfloat16()
    k_nope, k_rope = kv[..., :DN], latents[:, R:]
    keys = triton_expand_keys(k_nope, k_rope)
    assert keys.shape == (L, H, DN + DR) and keys.is_contiguous()
    assert torch.equal(keys, expand_keys(k_nope, k_rope))  # a CPU tensor: the twin
    assert torch.equal(keys[:, :, DN:], k_rope[:, None].expand(-1, H, -1))


def test_expand_keys_kernel_refuses_mismatched_inputs():
    k_nope = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one token count"):
        triton_expand_keys(k_nope, torch.zeros(3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="one dtype"):
        triton_expand_keys(k_nope, torch.zeros(4, 4))
    assert triton_expand_keys(k_nope[:0], torch.zeros(0, 4, dtype=torch.bfloat16)).shape == (0, 2, 12)


@pytest.mark.parametrize("T,D,M,launch", [(5, 40, 13, {}), (1, 3, 1, {}), (30, 300, 70, dict(rows=4, cols=128)),
                                           (9, 257, 0, {}), (17, 64, 33, dict(rows=1, cols=64, num_warps=1))])
def test_gather_rows_kernel_matches_index_select(T, D, M, launch):
    """The experts' row gather from strided rows (a column slice of a wider tensor), at widths and row counts off
    the kernel's tiles, repeats and all: index_select's rows bit for bit, contiguous."""
    gen = torch.Generator().manual_seed(T * D + M)
    x = torch.randn(T, D + 5, generator=gen).bfloat16()[:, :D]
    index = torch.randint(0, T, (M,), generator=gen)
    y = triton_gather_rows(x, index, **launch)
    assert y.shape == (M, D) and y.is_contiguous() and torch.equal(y, x.index_select(0, index))


def test_gather_rows_kernel_refuses_other_inputs():
    with pytest.raises(ValueError, match="1-D int64 index"):
        triton_gather_rows(torch.zeros(4, 8), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="unit column stride"):
        triton_gather_rows(torch.zeros(8, 4).t(), torch.zeros(3, dtype=torch.int64))


def test_silu_and_mul_kernel_refuses_an_odd_or_strided_last_dim():
    with pytest.raises(ValueError, match="even last dim"):
        triton_silu_and_mul(torch.zeros(2, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unit stride"):
        triton_silu_and_mul(torch.zeros(8, 2, dtype=torch.bfloat16).t())
