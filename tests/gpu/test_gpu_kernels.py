"""GPU kernels against their twins, on fresh random inputs at ragged shapes. Skipped without CUDA."""

import pytest
import torch
from helpers.kernels import PagedLatents, mostly_equal, norm_gemv_inputs, norm_inputs, rel_err, within_ulps

from deltaserve.kernels.kda import fused_recurrent_kda, kda_decode, kda_gate, l2norm
from deltaserve.kernels.kda.chunk import chunk_kda
from deltaserve.kernels.mla.naive import naive_mla
from deltaserve.kernels.moe.experts import grouped_experts
from deltaserve.kernels.moe.naive import naive_experts, naive_grouped_topk
from deltaserve.kernels.moe.triton_blocks import SORT_CHUNK, block_experts, expert_blocks, torch_expert_blocks
from deltaserve.kernels.moe.triton_routing import router_logits, triton_topk
from deltaserve.kernels.varlen import pack_seqs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = "cuda"


def kda_inputs(N, H, K, dtype, gen):
    qkv = torch.randn(N, 3, H, K, generator=gen, device=DEV).to(dtype)
    g_raw = torch.randn(N, H * K, generator=gen, device=DEV).to(dtype)
    b_raw = torch.randn(N, H, generator=gen, device=DEV).to(dtype)
    dt_bias = torch.randn(H * K, generator=gen, device=DEV) * 2 - 3
    a_log = torch.empty(H, device=DEV).uniform_(1, 16, generator=gen).log()
    return qkv, g_raw, b_raw, dt_bias, a_log


@pytest.mark.parametrize("B", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [128, 48])  # 48: not a power of two (the demo model's heads)
def test_triton_kda_decode_matches_torch_twin(B, dtype, K):
    gen = torch.Generator(device=DEV).manual_seed(B)
    H, S = 4, 40
    qkv, g_raw, b_raw, dt_bias, a_log = kda_inputs(B, H, K, dtype, gen)
    state = torch.randn(S, H, K, K, generator=gen, device=DEV) * 0.1
    slots = torch.randperm(S - 1, generator=gen, device=DEV)[:B]
    untouched = torch.ones(S, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    state[untouched] = 1e30
    twin_state = state.clone()
    o = kda_decode(qkv[:, 0], qkv[:, 1], qkv[:, 2], g_raw, b_raw, dt_bias, a_log, state, slots, K ** -0.5)
    beta = torch.sigmoid(b_raw.float())  # the fused kernel takes the sigmoid in float32
    o_twin = fused_recurrent_kda(l2norm(qkv[:, 0]), l2norm(qkv[:, 1]), qkv[:, 2].float(),
                                 kda_gate(g_raw, dt_bias, a_log), beta, K ** -0.5, twin_state, slots)
    # the kernel writes o in v's dtype (the reference's kernel rounds its output): bf16's rounding, 2^-9 at most
    assert o.dtype == dtype and rel_err(o, o_twin) < (1e-5 if dtype == torch.float32 else 4e-3)
    assert rel_err(state[slots], twin_state[slots]) < 1e-5
    assert torch.all(state[untouched] == 1e30)


@pytest.mark.parametrize("lengths", [[1], [63, 64, 65], [200, 1, 17]])
def test_fla_chunk_prefill_matches_torch_chunk(lengths):
    """fla-core's chunked kernel, its gate and beta formed inside from the raw projections, against our float32
    chunked path (kda_gate, sigmoid) from the same states."""
    pytest.importorskip("fla.ops.kda")
    from deltaserve.kernels.kda.fla_chunk import fla_chunk_kda

    gen = torch.Generator(device=DEV).manual_seed(sum(lengths))
    H, K, S = 4, 128, 8
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    qkv, g_raw, b_raw, dt_bias, a_log = kda_inputs(sum(lengths), H, K, torch.bfloat16, gen)
    g, beta = kda_gate(g_raw, dt_bias, a_log), torch.sigmoid(b_raw.float())
    state = torch.randn(S, H, K, K, generator=gen, device=DEV) * 0.1
    twin_state = state.clone()
    slots = list(range(1, len(lengths) + 1))
    o = fla_chunk_kda(qkv[:, 0], qkv[:, 1], qkv[:, 2], g_raw, b_raw, dt_bias, a_log, K ** -0.5, state,
                      pack_seqs(slots, cu, DEV))
    o_twin = chunk_kda(l2norm(qkv[:, 0]), l2norm(qkv[:, 1]), qkv[:, 2].float(), g, beta, K ** -0.5, twin_state,
                       slots, cu)
    assert rel_err(o, o_twin) < 2e-2
    assert rel_err(state[slots], twin_state[slots]) < 2e-2


@pytest.mark.parametrize("lengths", [[1], [5, 32, 2], [31, 1, 17, 9]])
def test_short_bf16_prefill_runs_the_recurrent_kernel_and_matches_torch_chunk(lengths):
    """kda_prefill in bfloat16 at lengths up to RECURRENT_PREFILL_MAX_LEN: our recurrent kernel (no fla-core),
    against the float32 chunked torch path from the same states."""
    from deltaserve.kernels.kda import RECURRENT_PREFILL_MAX_LEN, kda_prefill

    assert max(lengths) <= RECURRENT_PREFILL_MAX_LEN
    gen = torch.Generator(device=DEV).manual_seed(sum(lengths))
    H, K, S = 4, 128, 8
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    qkv, g_raw, b_raw, dt_bias, a_log = kda_inputs(sum(lengths), H, K, torch.bfloat16, gen)
    state = torch.randn(S, H, K, K, generator=gen, device=DEV) * 0.1
    twin_state = state.clone()
    slots = list(range(len(lengths), 0, -1))
    o = kda_prefill(qkv[:, 0], qkv[:, 1], qkv[:, 2], g_raw, b_raw, dt_bias, a_log, state, slots, cu, K ** -0.5)
    g, beta = kda_gate(g_raw, dt_bias, a_log), torch.sigmoid(b_raw.float())  # the kernel's sigmoid is float32's
    o_twin = chunk_kda(l2norm(qkv[:, 0]), l2norm(qkv[:, 1]), qkv[:, 2].float(), g, beta, K ** -0.5, twin_state,
                       slots, cu)
    # o rounded to bf16 in the kernel (2^-9 at most); the states differ by float32's order of summation only
    assert o.dtype == torch.bfloat16 and rel_err(o, o_twin) < 4e-3
    assert rel_err(state[slots], twin_state[slots]) < 1e-4


@pytest.mark.parametrize("T,E,k", [(1, 256, 8), (5, 16, 2), (300, 64, 8), (64, 256, 8)])
@pytest.mark.parametrize("path", [grouped_experts, block_experts])
def test_grouped_experts_match_naive(T, E, k, path):
    """Both batch paths (torch._grouped_mm, and the sorted-block Triton kernels) against the per-pair spec."""
    gen = torch.Generator(device=DEV).manual_seed(T)
    D, I = 256, 128
    x = torch.randn(T, D, generator=gen, device=DEV).bfloat16()
    w13 = (torch.randn(E, 2 * I, D, generator=gen, device=DEV) * 0.05).bfloat16()
    w2 = (torch.randn(E, D, I, generator=gen, device=DEV) * 0.05).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen, device=DEV)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen, device=DEV)
    out = path(x, w13, w2, weights, ids)
    ref = naive_experts(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    assert rel_err(out.cpu(), ref) < 2e-2


@pytest.mark.parametrize("T,E,k", [(5, 16, 8), (64, 256, 8), (256, 256, 8), (511, 7, 4), (33, 300, 3)])
def test_expert_blocks_kernel_matches_twin(T, E, k):
    """The pairs placed into expert blocks, a program a chunk (histograms and a barrier compiled), against the
    torch twin, every output equal, at uniform routing and at a skewed one (every token on the same k experts: many
    blocks each)."""
    gen = torch.Generator(device=DEV).manual_seed(T + E)
    uniform = torch.rand(T, E, generator=gen, device=DEV).topk(k, dim=-1)[1]
    for ids in (uniform, uniform[:1].expand(T, k)):
        for chunk in (8, SORT_CHUNK):
            for got, want in zip(expert_blocks(ids, E, chunk=chunk), torch_expert_blocks(ids, E)):
                assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(32, 128, 128), (3, 4097)])
def test_copy_rows_kernel_matches_twin(shape):
    """A request's KDA state rows copied slot to slot in every layer in one pass, as the torch twin copies them."""
    from deltaserve.kernels.cache_ops import copy_rows
    from deltaserve.kernels.triton_copy import triton_copy_rows

    gen = torch.Generator(device=DEV).manual_seed(len(shape))
    source, target = (torch.randn(3, 9, *shape, generator=gen, device=DEV) for _ in range(2))
    src, dst = torch.tensor([4, 0, 8], device=DEV), torch.tensor([1, 7, 0], device=DEV)
    want = target.clone()
    want[:, dst] = source[:, src]
    copy_rows(source, target, src, dst)  # a GPU tensor: the kernel
    assert torch.equal(target, want)
    triton_copy_rows(source, target, dst, src)  # and straight, the other way
    want[:, src] = source[:, dst]
    assert torch.equal(target, want)


def test_copy_rows_kernel_addresses_past_two_to_the_31():
    """Rows past 2**31 elements into the stack (as 20 layers of 256 KDA states are) land where the torch copy puts
    them: the slot and layer offsets are int64 products."""
    from deltaserve.kernels.triton_copy import triton_copy_rows

    source = torch.zeros(3, 4, (1 << 28) + 7, dtype=torch.uint8, device=DEV)
    source[2, 3, -5:] = torch.arange(1, 6, dtype=torch.uint8, device=DEV)
    source[1, 0, :3] = 9
    target = torch.zeros_like(source)
    triton_copy_rows(source, target, torch.tensor([3, 0], device=DEV), torch.tensor([3, 1], device=DEV))
    assert target[2, 3, -5:].tolist() == [1, 2, 3, 4, 5] and target[1, 1, :3].tolist() == [9, 9, 9]
    assert int(target[:, 0].sum()) == 0 and int(target[:, 2].sum()) == 0
    del source, target


@pytest.mark.parametrize("T,start", [(1, 0), (37, 0), (16, 40)])
def test_sdpa_mla_prefill_matches_naive(T, start):
    from deltaserve.kernels.mla.attention import mla_prefill

    gen = torch.Generator(device=DEV).manual_seed(T + start)
    H, R, Dn, Dr, Dv = 4, 64, 32, 16, 32
    L = start + T
    latents = torch.randn(L, R + Dr, generator=gen, device=DEV)
    w_kv_b = torch.randn(H * (Dn + Dv), R, generator=gen, device=DEV) * 0.1
    q_nope = torch.randn(T, H, Dn, generator=gen, device=DEV)
    q_rope = torch.randn(T, H, Dr, generator=gen, device=DEV)
    kv = (latents[:, :R] @ w_kv_b.t()).view(L, H, Dn + Dv)
    out = mla_prefill(q_nope, q_rope, kv[..., :Dn], latents[:, R:], kv[..., Dn:], (Dn + Dr) ** -0.5, start)
    ref = naive_mla(q_nope, q_rope, latents, w_kv_b, (Dn + Dr) ** -0.5, start)
    assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("T,L,causal", [(1, 1, True), (63, 63, True), (129, 129, True), (300, 300, True),
                                        (1, 77, False), (65, 4097, False), (16, 300_001, False)])
def test_fused_attention_lse_backends_match_twin(backend, T, L, causal):
    """Each backend of the MLA prefill attention, at the 48B shape's widths (keys 192, values 128) in bf16,
    ragged lengths around the kernels' tiles, and a block of keys past 262,144, against the float32 twin."""
    from deltaserve.kernels.mla.prefill import attention_lse, attention_lse_naive

    gen = torch.Generator(device=DEV).manual_seed(T * 7 + L)
    H = 4
    q = torch.randn(T, H, 192, generator=gen, device=DEV).bfloat16()
    k = torch.randn(L, H, 192, generator=gen, device=DEV).bfloat16()
    v = torch.randn(L, H, 128, generator=gen, device=DEV).bfloat16()
    try:
        out, lse = attention_lse(q, k, v, 192 ** -0.5, causal, backend=backend)
    except RuntimeError as e:  # a backend this build lacks is skipped; the chosen one is tested below
        pytest.skip(f"{backend} does not run these shapes here: {str(e)[:100]}")
    ref, ref_lse = attention_lse_naive(q, k, v, 192 ** -0.5, causal)
    assert out.shape == (T, H, 128) and out.dtype == torch.bfloat16 and lse.shape == (T, H)
    assert rel_err(out.float(), ref.float()) < 2e-2
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-2)


@pytest.mark.parametrize("T", [8192, 300])
def test_cudnn_attention_takes_queries_as_the_layer_slices_them(T):
    """MLA's prefill queries are a view of in_proj's output (rows of H * 192 + 576), and values a view of kv_b_proj's
    (each head's last 128 of 256): cuDNN takes them as they lie (no error, so the backend probe never falls to a
    slower kernel over strides), agreeing with contiguous copies."""
    from deltaserve.kernels.mla.prefill import attention_lse

    gen = torch.Generator(device=DEV).manual_seed(T)
    H = 32
    projected = torch.randn(T, H * 192 + 576, generator=gen, device=DEV).bfloat16()
    kv = torch.randn(T, H, 256, generator=gen, device=DEV).bfloat16()
    q, k = projected[:, : H * 192].view(T, H, 192), torch.randn(T, H, 192, generator=gen, device=DEV).bfloat16()
    out, lse = attention_lse(q, k, kv[..., 128:], 192 ** -0.5, True, backend="cudnn")
    ref, ref_lse = attention_lse(q.contiguous(), k, kv[..., 128:].contiguous(), 192 ** -0.5, True, backend="cudnn")
    assert rel_err(out.float(), ref.float()) < 1e-2
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-2)


def test_fused_attention_lse_chooses_a_backend():
    from deltaserve.kernels.mla.prefill import _chosen, attention_lse

    q = torch.randn(40, 2, 192, device=DEV).bfloat16()
    attention_lse(q, q, q[..., :128], 0.1, True)
    assert _chosen[(str(q.device), torch.bfloat16)] in ("cudnn", "flash", "efficient")


@pytest.mark.parametrize("T,start,block", [(1, 0, 64), (97, 0, 64), (33, 200, 64), (8, 130, 65), (300, 5000, 4096)])
def test_fused_mla_prefill_matches_naive(T, start, block):
    """The fused prefill in bf16 (own keys causal, the cached ones in blocks, merged) against the naive MLA."""
    from deltaserve.kernels.mla.attention import mla_prefill_fused

    gen = torch.Generator(device=DEV).manual_seed(T + start + block)
    H, R, Dn, Dr, Dv = 4, 64, 128, 64, 128
    L = start + T
    latents = torch.randn(L, R + Dr, generator=gen, device=DEV)
    w_kv_b = torch.randn(H * (Dn + Dv), R, generator=gen, device=DEV) * 0.1
    q_nope = torch.randn(T, H, Dn, generator=gen, device=DEV)
    q_rope = torch.randn(T, H, Dr, generator=gen, device=DEV)

    def expand(lo, hi):
        part = latents[lo:hi]
        kv = (part[:, :R] @ w_kv_b.t()).view(part.shape[0], H, Dn + Dv).bfloat16()
        return torch.cat([kv[..., :Dn], part[:, None, R:].expand(-1, H, -1).bfloat16()], dim=-1), kv[..., Dn:]

    out = mla_prefill_fused(torch.cat([q_nope, q_rope], dim=-1).bfloat16(), expand, (Dn + Dr) ** -0.5, start, block)
    assert rel_err(out.float(), naive_mla(q_nope, q_rope, latents, w_kv_b, (Dn + Dr) ** -0.5, start)) < 2e-2


@pytest.mark.parametrize("B", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_conv_update_matches_naive(B, dtype):
    from deltaserve.kernels.conv1d import causal_conv1d_update
    from deltaserve.kernels.kda.naive import naive_causal_conv1d

    gen = torch.Generator(device=DEV).manual_seed(B)
    C, W, S = 3 * 4 * 128 + 8, 4, 12
    x = torch.randn(B, 2 * C, generator=gen, device=DEV).to(dtype)[:, :C]  # strided rows, as in_proj's split
    weight = torch.randn(C, W, generator=gen, device=DEV).to(dtype)
    state = torch.randn(S, C, W - 1, generator=gen, device=DEV).to(dtype)
    slots = torch.randperm(S, generator=gen, device=DEV)[:B]
    before = state.clone()
    y = causal_conv1d_update(x, weight, state, slots)
    for b, slot in enumerate(slots.tolist()):
        y_ref, s_ref = naive_causal_conv1d(x[b:b + 1].float(), weight.float(), before[slot].float())
        assert rel_err(y[b:b + 1], y_ref) < 1e-2
        assert torch.equal(state[slot].float(), s_ref.to(dtype).float())


@pytest.mark.parametrize("lengths", [[1, 2, 3, 700], [4096], [33, 1, 5]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_conv_varlen_matches_naive(lengths, dtype):
    """Prefill's conv kernels (the 48B shape's 12,288 channels): packed sequences, strided rows, slots out of order,
    each sequence's output and state against the naive conv; the other slots untouched."""
    from deltaserve.kernels.conv1d import causal_conv1d_varlen
    from deltaserve.kernels.kda.naive import naive_causal_conv1d

    gen = torch.Generator(device=DEV).manual_seed(len(lengths))
    C, W, S = 3 * 32 * 128, 4, 9
    cu = torch.tensor([0] + lengths).cumsum(0).tolist()
    x = torch.randn(cu[-1], C + 64, generator=gen, device=DEV).to(dtype)[:, :C]
    weight = torch.randn(C, W, generator=gen, device=DEV).to(dtype)
    state = torch.randn(S, C, W - 1, generator=gen, device=DEV).to(dtype)
    slots = torch.randperm(S, generator=gen, device=DEV)[:len(lengths)].tolist()
    before = state.clone()
    y = causal_conv1d_varlen(x, weight, state, slots, cu)
    for b, slot in enumerate(slots):
        y_ref, s_ref = naive_causal_conv1d(x[cu[b]:cu[b + 1]].float(), weight.float(), before[slot].float())
        assert rel_err(y[cu[b]:cu[b + 1]], y_ref) < (1e-5 if dtype == torch.float32 else 1e-2)
        assert torch.equal(state[slot].float(), s_ref.to(dtype).float())
    others = [s for s in range(S) if s not in slots]
    assert torch.equal(state[others], before[others])


def test_triton_conv_varlen_in_groups_and_states_at_match_twins():
    """The 48B shape's conv with q, k and v stored apart (each contiguous, the twin's values) and conv states
    partway into snapshot slots (a cut at the first token, one inside the kernel's width, a long one), compiled."""
    from deltaserve.kernels.conv1d import causal_conv1d_varlen, conv_states_at

    gen = torch.Generator(device=DEV).manual_seed(3)
    C, W, lengths = 3 * 32 * 128, 4, [700, 2, 90]
    cu = torch.tensor([0] + lengths).cumsum(0).tolist()
    x = torch.randn(cu[-1], C + 64, generator=gen, device=DEV).to(torch.bfloat16)[:, :C]
    weight = torch.randn(C, W, generator=gen, device=DEV).to(torch.bfloat16)
    state = torch.randn(5, C, W - 1, generator=gen, device=DEV).to(torch.bfloat16)
    snapshots = torch.zeros(4, C, W - 1, device=DEV, dtype=torch.bfloat16)
    twin_state, twin_snapshots = state.cpu().float(), snapshots.cpu().float()
    index = lambda values: torch.tensor(values, device=DEV)  # noqa: E731
    args = index([4, 0, 2]), index([1, 3, 0]), index([0, 701, 702]), index([0, 702, 740])
    conv_states_at(x, state, snapshots, *args)
    conv_states_at(x.cpu().float(), twin_state, twin_snapshots, *(a.cpu() for a in args))
    assert torch.equal(snapshots.cpu().float(), twin_snapshots)
    y = causal_conv1d_varlen(x, weight, state, [4, 0, 2], cu, groups=3)
    want = causal_conv1d_varlen(x.cpu().float(), weight.cpu().float(), twin_state, [4, 0, 2], cu, groups=3)
    assert all(y[:, g].is_contiguous() for g in range(3)) and rel_err(y, want) < 1e-2
    assert torch.equal(state.cpu().float(), twin_state.bfloat16().float())


@pytest.mark.parametrize("T,E,k", [(1, 256, 8), (3, 64, 8), (2, 16, 2)])
@pytest.mark.parametrize("with_shared", [False, True])
def test_triton_decode_experts_match_naive(T, E, k, with_shared):
    """At the 48B shape (tiles autotuned), with and without the shared expert as one more slot."""
    from deltaserve.kernels.moe.triton_decode import decode_experts

    gen = torch.Generator(device=DEV).manual_seed(T + E)
    D, I = 2304, 1024
    x = torch.randn(T, D, generator=gen, device=DEV).bfloat16()
    w13 = (torch.randn(E, 2 * I, D, generator=gen, device=DEV) * 0.02).bfloat16()
    w2 = (torch.randn(E, D, I, generator=gen, device=DEV) * 0.02).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen, device=DEV)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen, device=DEV)
    shared = (w13[-1].clone(), w2[-1].clone()) if with_shared else None
    out = decode_experts(x, w13, w2, weights, ids, shared=shared)
    ref = naive_experts(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    if with_shared:  # the shared expert equals routed expert E-1 at weight 1
        ref = ref + naive_experts(x.cpu(), w13.cpu(), w2.cpu(), torch.ones(T, 1), torch.full((T, 1), E - 1))
    assert rel_err(out.cpu(), ref) < 2e-2


@pytest.mark.parametrize("T,E,k", [(1, 256, 8), (37, 256, 8), (3, 40, 3)])
def test_routing_kernel_matches_naive(T, E, k):
    gen = torch.Generator().manual_seed(T + E)
    logits, bias = torch.randn(T, E, generator=gen) * 2, torch.randn(E, generator=gen) * 0.1
    weights, ids = triton_topk(logits.to(DEV), bias.to(DEV), k, True, 2.446)
    ref_weights, ref_ids = naive_grouped_topk(logits, bias, k, 1, 1, True, 2.446)
    order, ref_order = ids.cpu().sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    assert torch.allclose(weights.cpu().gather(1, order.indices), ref_weights.gather(1, ref_order.indices),
                          rtol=1e-5, atol=1e-6)


def _mla_decode_against_twin(lengths, width, cache_dtype, seed, **knobs):
    """triton_mla_decode (with knobs) at the 48B model's MLA shape (32 heads, R 512, Dr 64, pages of 16) on a cache of
    cache_dtype (queries in float32 for a float32 cache, else bf16), and its relative error against the torch path
    in float32 on the same values: (out, rel_err). Block tables `width` pages wide (default: the longest's)."""
    from deltaserve.kernels.mla.attention import torch_mla_decode
    from deltaserve.kernels.mla.triton_decode import triton_mla_decode

    gen = torch.Generator().manual_seed(seed)
    H, R, DR = 32, 512, 64
    q_dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    num_pages = max(400, sum(-(-n // 16) for n in lengths) + 8)
    paged = PagedLatents(lengths, R + DR, 16, num_pages, gen, dtype=cache_dtype, device=DEV)
    tables = paged.block_tables(width)
    q_latent = (torch.randn(len(lengths), H, R, generator=gen) * 0.05).to(q_dtype).to(DEV)
    q_rope = (torch.randn(len(lengths), H, DR, generator=gen) * 0.05).to(q_dtype).to(DEV)
    lens = torch.tensor(lengths, device=DEV)
    out = triton_mla_decode(q_latent, q_rope, paged.cache, tables, lens, 192 ** -0.5, **knobs)
    used = tables[:, : -(-max(lengths) // 16)]
    twin = torch_mla_decode(q_latent.float(), q_rope.float(), paged.cache.float(), used, lens, 192 ** -0.5)
    return out, rel_err(out, twin)


@pytest.mark.parametrize("lengths,width", [([1], None), ([17, 300, 1, 4097], None), ([33, 2, 700], 65536 // 16),
                                           ([131071], 1 << 16), ([131072], 1 << 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mla_decode_matches_torch_twin(lengths, width, dtype):
    """The 48B model's MLA shape against the torch path, default launch; the widest tables are CUDA graphs' for a 64k
    and a 1M model length, their entries past each context unread. One sequence just short of WIDE_FROM and one at
    it: 16 heads a program, then all of them."""
    _, err = _mla_decode_against_twin(lengths, width, dtype, len(lengths))
    assert err < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("lengths,wide_from", [([17, 300, 1, 4097], 300), ([70001], 1), ([70001], 65536)])
def test_triton_mla_decode_wide_mode_matches_torch_twin(lengths, wide_from):
    """bf16, 16 heads a program: sequences of wide_from tokens or more attended with all 32 heads a program over
    slices of their own, the others by head block."""
    _, err = _mla_decode_against_twin(lengths, None, torch.bfloat16, len(lengths) + wide_from, max_head_block=16,
                                      wide_from=wide_from)
    assert err < 1e-2


@pytest.mark.parametrize("reread_tile", [False, True])
def test_triton_mla_decode_reads_a_float8_cache(reread_tile):
    """--kv-cache-dtype fp8: bf16 queries against a float8_e4m3fn cache, widened as read (the tile read once, or once
    for each product)."""
    out, err = _mla_decode_against_twin([3000, 17, 700], 4096, torch.float8_e4m3fn, 5, reread_tile=reread_tile)
    assert out.dtype == torch.bfloat16 and err < 1e-2


@pytest.mark.parametrize("T", [1, 5, 16])
def test_router_logits_kernel_matches_float32_linear(T):
    gen = torch.Generator(device=DEV).manual_seed(T)
    x = torch.randn(T, 2304, generator=gen, device=DEV).bfloat16()
    weight = torch.randn(256, 2304, generator=gen, device=DEV) * 0.05
    assert rel_err(router_logits(x, weight), torch.nn.functional.linear(x.float(), weight)) < 1e-5


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("N,K", [(2304, 4096), (6720, 2304), (12576, 2304), (1000, 4200)])  # the 48B's, a ragged
def test_gemv_kernel_matches_linear(T, N, K):
    from deltaserve.kernels.gemv import gemv

    gen = torch.Generator(device=DEV).manual_seed(T * N)
    x = torch.randn(T, 2 * K, generator=gen, device=DEV).bfloat16()[:, :K]
    weight = (torch.randn(N, K, generator=gen, device=DEV) * 0.02).bfloat16()
    y = gemv(x, weight)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, torch.nn.functional.linear(x.float(), weight.float())) < 5e-3


def test_linear_takes_the_gemv_for_a_few_tokens_only(monkeypatch):
    """Linear runs gemv() for <= GEMV_MAX_TOKENS tokens of a large bf16 weight, cuBLAS otherwise and for lm_head."""
    import deltaserve.kernels.gemv as gemv_module
    from deltaserve.layers.linear import Linear

    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda x, w, **k: calls.append(x.shape[0]) or real(x, w, **k))
    layer = Linear(2304, 4096, dtype=torch.bfloat16).to(DEV)
    torch.nn.init.normal_(layer.weight, std=0.02)
    for T in (1, 2, 5):
        x = torch.randn(T, 2304, device=DEV).bfloat16()
        assert rel_err(layer(x), torch.nn.functional.linear(x, layer.weight)) < 5e-3
    assert calls == [1]
    layer.gemv = False
    layer(torch.randn(1, 2304, device=DEV).bfloat16())
    assert calls == [1]


def test_grouped_gemv_matches_kdas_two_up_projections():
    """KDA's f_b and g_b up-projections of one token (the 48B shape) in one launch, against the two products."""
    from deltaserve.kernels.gemv import gemv

    gen = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(1, 256, generator=gen, device=DEV).bfloat16()
    weight = (torch.randn(8192, 128, generator=gen, device=DEV) * 0.05).bfloat16()
    y = gemv(x, weight, groups=2)
    F = torch.nn.functional
    assert rel_err(y[:, :4096], F.linear(x[:, :128].float(), weight[:4096].float())) < 5e-3
    assert rel_err(y[:, 4096:], F.linear(x[:, 128:].float(), weight[4096:].float())) < 5e-3


@pytest.mark.parametrize("T,N,weight_dtype", [(1, 12576, torch.bfloat16), (1, 6720, torch.bfloat16),  # KDA, MLA in_proj
                                              (1, 256, torch.float32), (5, 256, torch.float32),  # the router
                                              (16, 256, torch.float32), (1, 1000, torch.bfloat16)])
def test_add_norm_gemv_matches_norm_then_linear(T, N, weight_dtype):
    """The residual stream bit for bit; the normalised input within one unit in the last place (the mean square is
    summed in another order) and nearly always equal; the product as the twin's."""
    from deltaserve.kernels.norm_gemv import add_norm_gemv, naive_add_norm_linear

    case = norm_gemv_inputs(T, 2304, N, weight_dtype, seed=T * N, device=DEV)
    args = case["x"], case["residual"], case["norm_weight"], case["eps"], case["weight"]
    y, s, h = add_norm_gemv(*args, store_normed=True)
    y_twin, s_twin, h_twin = naive_add_norm_linear(*args)
    assert torch.equal(s, s_twin) and within_ulps(h, h_twin) and (h == h_twin).float().mean() > 0.99
    assert y.dtype == weight_dtype and rel_err(y, y_twin) < (5e-3 if weight_dtype == torch.bfloat16 else 1e-3)


@pytest.mark.parametrize("T,H,K,N", [(1, 32, 128, 2304), (1, 7, 64, 1000)])  # the 48B's o_proj, a ragged one
def test_gated_norm_gemv_matches_gated_norm_then_linear(T, H, K, N):
    from deltaserve.kernels.norm_gemv import gated_norm_gemv, naive_gated_norm_linear

    case = norm_gemv_inputs(T, K, N, torch.bfloat16, seed=H * N, device=DEV, gated_heads=H)
    args = case["o"], case["gate"], case["norm_weight"], case["eps"], case["weight"]
    assert rel_err(gated_norm_gemv(*args), naive_gated_norm_linear(*args)) < 5e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2304), (37, 512), (5, 3, 300), (200, 4, 128)])
def test_norm_kernels_match_their_eager_twins(shape, dtype):
    """kernels.triton_norm compiled (the norms of every GPU step but the fused batch-1 ones) against kernels.norm's
    eager functions on the GPU, strided operands as the layers pass them: half precision all but a few elements bit
    for bit (the mean square summed in another order, approximate rsqrt and sigmoid), none by more than 2 units in
    the last place; the residual sum bit for bit; float32 within 1e-6."""
    from deltaserve.kernels import triton_norm
    from deltaserve.kernels.norm import add_rms_norm, gated_rms_norm, rms_norm

    case = norm_inputs(shape, dtype, seed=sum(shape), device=DEV)
    x, residual, gate, weight, eps = case["x"], case["residual"], case["gate"], case["weight"], case["eps"]

    def close(a, b):
        return mostly_equal(a, b) if dtype != torch.float32 else rel_err(a, b) < 1e-6

    assert close(triton_norm.rms_norm(x, weight, eps), rms_norm.eager(x, weight, eps))
    normed, total = triton_norm.add_rms_norm(x, residual, weight, eps)
    normed_twin, total_twin = add_rms_norm.eager(x, residual, weight, eps)
    assert torch.equal(total, total_twin) and close(normed, normed_twin)
    for w in (weight, case["weight32"]):
        assert close(triton_norm.gated_rms_norm(x, gate, w, eps), gated_rms_norm.eager(x, gate, w, eps))


@pytest.mark.parametrize("T,slots", [(1, 9), (16, 9), (3, 8)])
def test_slot_sum_kernel_is_torch_sum(T, slots):
    """In slot order; torch's reduction may pair the slots otherwise: float32 to 1e-6, bf16 within one rounding."""
    from deltaserve.kernels.moe.triton_decode import _sum_slots

    y = torch.randn(T, slots, 2304, generator=torch.Generator(device=DEV).manual_seed(T), device=DEV)
    assert rel_err(_sum_slots(y, torch.float32), y.sum(1)) < 1e-6
    assert mostly_equal(_sum_slots(y, torch.bfloat16), y.sum(1).to(torch.bfloat16), ulps=1)


@pytest.mark.parametrize("M,I", [(1, 1024), (300, 1024), (4099, 1408), (65, 9216)])
def test_silu_and_mul_kernel_is_one_rounding_of_float32(M, I):
    """SwiGLU's activation kernel (the grouped experts' [tokens x k, 2I], the dense MLP's 2 x 9,216) against the
    float32 product rounded once."""
    from deltaserve.kernels.activation import silu_and_mul

    gen = torch.Generator(device=DEV).manual_seed(M)
    x = (torch.randn(M, 2 * I, generator=gen, device=DEV) * 4).to(torch.bfloat16)
    gate, up = x.float().chunk(2, dim=-1)
    assert within_ulps(silu_and_mul(x), (torch.nn.functional.silu(gate) * up).bfloat16(), 1)


@pytest.mark.parametrize("L,H", [(1, 32), (8191, 32), (65536, 32), (300, 3)])
def test_expand_keys_kernel_equals_the_cat(L, H):
    """MLA prefill's keys (kv_b_proj's k_nope columns beside the shared k_rope) bit for bit the twin's torch.cat, up
    to a long prefill's block of 65,536 cached keys."""
    from deltaserve.kernels.mla.keys import expand_keys

    gen = torch.Generator(device=DEV).manual_seed(L)
    kv = torch.randn(L, H, 256, generator=gen, device=DEV).bfloat16()
    latents = torch.randn(L, 576, generator=gen, device=DEV).bfloat16()
    twin = torch.cat([kv[..., :128], latents[:, None, 512:].expand(-1, H, -1)], dim=-1)
    assert torch.equal(expand_keys(kv[..., :128], latents[:, 512:]), twin)


@pytest.mark.parametrize("T,D,k", [(8192, 2304, 8), (3, 2304, 8), (1000, 7168, 2)])
def test_grouped_experts_row_gather_equals_index_select(T, D, k):
    """The grouped experts' rows sorted by expert (kernels.triton_copy's gather) bit for bit index_select's, up to an
    8k chunk's 65,536 rows."""
    from deltaserve.kernels.moe.experts import sort_by_expert
    from deltaserve.kernels.triton_copy import triton_gather_rows

    gen = torch.Generator(device=DEV).manual_seed(T)
    x = torch.randn(T, D, generator=gen, device=DEV).bfloat16()
    token = sort_by_expert(torch.rand(T, 256, generator=gen, device=DEV).topk(k, dim=-1).indices, 256)[1]
    assert torch.equal(triton_gather_rows(x, token), x.index_select(0, token))


def test_router_logits_from_bf16_weights_match_float32():
    """The router's tensor-core GEMM (MoE.choose_router_gemm) where bfloat16 holds its weights, as dummy weights
    are drawn: the float32 GEMM's logits up to the order of summation, for a prefill chunk's rows; weights bf16 does
    not hold keep the float32 GEMM."""
    import json

    from helpers.checkpoints import CONFIG_48B

    from deltaserve.config import ModelConfig
    from deltaserve.kernel_options import KernelOptions
    from deltaserve.layers.moe import MoE
    from deltaserve.loader.model_loader import build_model, init_dummy_weights

    raw = json.loads(CONFIG_48B.read_text())
    raw["num_hidden_layers"] = 2  # a dense layer and one MoE layer of the 48B shape
    raw["linear_attn_config"] = {**raw["linear_attn_config"], "kda_layers": [1], "full_attn_layers": [2]}
    model = build_model(ModelConfig.from_dict(raw), torch.bfloat16, DEV)
    init_dummy_weights(model, 0)
    model.set_kernel_options(KernelOptions())
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert moe._router_bf16 is not None
    x = torch.randn(3000, raw["hidden_size"], device=DEV).bfloat16()
    assert rel_err(moe._router_logits(x), torch.nn.functional.linear(x.float(), moe.gate_weight)) < 1e-5
    moe.gate_weight.data += 1e-5  # no longer values of bfloat16
    moe.choose_router_gemm()
    assert moe._router_bf16 is None
    assert torch.equal(moe._router_logits(x), torch.nn.functional.linear(x.float(), moe.gate_weight))
