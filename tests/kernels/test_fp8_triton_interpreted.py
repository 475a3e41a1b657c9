"""The FP8 Triton kernels against their twins on the CPU, through Triton's interpreter (which loads float8_e4m3fn):
the dequantize kernel equals the CPU fallback bit for bit, the weight-only matmul and the expert GEMVs match the
naive twins. On a machine with CUDA, tests/gpu/test_gpu_fp8.py runs them compiled instead."""

import pytest
import torch
from helpers.kernels import (
    fp8_expert_case,
    norm_gemv_inputs,
    quantized,
    rel_err,
    require_triton_interpreter,
    within_ulps,
)

require_triton_interpreter()

from deltaserve.kernels.gemv import FP8_GEMV_TILES, fp8_gemv  # noqa: E402
from deltaserve.kernels.moe.naive import naive_experts  # noqa: E402
from deltaserve.kernels.moe.triton_decode import _DOWN_TILES, _GATE_UP_TILES, decode_experts  # noqa: E402
from deltaserve.kernels.norm_gemv import add_norm_gemv, gated_norm_gemv, naive_add_norm_linear, naive_gated_norm_linear  # noqa: E402
from deltaserve.kernels.quant import FP8, dequantize_fp8  # noqa: E402
from deltaserve.kernels.quant.naive import naive_fp8_linear  # noqa: E402
from deltaserve.kernels.quant.triton_linear import fp8_dequantize_triton, fp8_matmul  # noqa: E402


@pytest.mark.parametrize("shape,block", [((33, 130), (128, 128)), ((2, 70, 45), (16, 24)), ((129, 257), (32, 64))])
def test_dequantize_kernel_equals_the_cpu_fallback_bit_for_bit(shape, block):
    """In float32 (the product itself). The interpreter truncates float32 -> bfloat16 where a GPU rounds to
    nearest even, so the bfloat16 output is compared bit for bit on a GPU only (tests/gpu/test_gpu_fp8.py)."""
    q, scale = quantized(shape, block, sum(shape))
    assert q.dtype == FP8
    dtype = torch.float32
    assert torch.equal(fp8_dequantize_triton(q, scale, block, dtype), dequantize_fp8(q, scale, block, dtype))


@pytest.mark.parametrize("M,N,K,block,splits", [
    (1, 70, 130, (128, 128), None), (3, 129, 64, (16, 24), None), (17, 40, 200, (32, 64), None),
    (2, 130, 700, (128, 128), 3),  # aligned tiles (one scale per tile), K split into 3 ranges, ragged last
    (1, 66, 300, (64, 128), 2),  # aligned, the last K range partly past K
])
def test_weight_only_matmul_matches_twin(M, N, K, block, splits):
    """In float32: the interpreter's tl.dot on bfloat16 operands returns garbage (bfloat16 is emulated), so
    bfloat16 activations are checked on a GPU only (tests/gpu/test_gpu_fp8.py)."""
    q, scale = quantized((N, K), block, M * N)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K))
    assert rel_err(fp8_matmul(x, q, scale, block, splits), naive_fp8_linear(x, q, scale, block)) < 1e-5


def test_weight_only_matmul_never_reads_past_the_scales():
    """K split into ranges of 384 over K = 1024: the last range ends past K, where a scale index would fall past the
    last scale column (and, in the last row tile, past the tensor: here a NaN)."""
    block = (128, 128)
    q, scale = quantized((130, 1024), block, 5)
    buffer = torch.full((scale.numel() + 8,), float("nan"))
    buffer[: scale.numel()] = scale.flatten()
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(5))
    y = fp8_matmul(x, q, buffer[: scale.numel()].view(scale.shape), block, splits=3)
    assert not y.isnan().any() and rel_err(y, naive_fp8_linear(x, q, scale, block)) < 1e-5
    assert fp8_matmul(x[:0], q, scale, block).shape == (0, 130)


@pytest.mark.parametrize("T,E,k,D,I,block", [
    (1, 8, 2, 96, 40, (16, 32)), (3, 16, 4, 96, 40, (16, 32)),  # not multiples of the kernels' tiles nor the blocks
    (2, 8, 2, 256, 256, (128, 128)),  # aligned: one scale per tile
])
def test_fp8_decode_experts_kernel_matches_naive(T, E, k, D, I, block):
    x, w13, s13, w2, s2, weights, ids, expected = fp8_expert_case(T, E, k, D, I, block, seeds=(T * E, T, E))
    assert rel_err(decode_experts(x, w13, w2, weights, ids, s13, s2, block), expected) < 1e-5


@pytest.mark.parametrize("T,block", [(1, (16, 32)), (3, (128, 128))])
def test_fp8_decode_experts_kernel_with_the_shared_expert_matches_naive(T, block):
    """The FP8 shared expert (its own block scales) as one more slot: expert 0's weights and scales at weight 1."""
    D, I = (96, 40) if block == (16, 32) else (256, 256)
    x, w13, s13, w2, s2, weights, ids, expected = fp8_expert_case(T, 8, 2, D, I, block, seeds=(T, 1, 2),
                                                                  experts=list(range(1, 8)))
    shared = (w13[0], w2[0], s13[0], s2[0])
    expected = expected + naive_experts(x, dequantize_fp8(w13, s13, block), dequantize_fp8(w2, s2, block),
                                        torch.ones(T, 1), torch.zeros(T, 1, dtype=torch.int64))
    assert rel_err(decode_experts(x, w13, w2, weights, ids, s13, s2, block, shared=shared), expected) < 1e-5


@pytest.mark.parametrize("tiles", list(zip(_GATE_UP_TILES, _DOWN_TILES)))
@pytest.mark.parametrize("block,D,I", [((16, 32), 160, 72), ((128, 128), 160, 72), ((128, 128), 256, 256)])
def test_every_autotuned_expert_tile_gives_the_naive_values(tiles, block, D, I):
    """The interpreter autotunes nothing (one config): each candidate tile, run directly, at ragged and at aligned
    shapes, with block scales (one per tile or per element: the heuristic decides) and without, with the shared
    expert's slot."""
    x, w13, s13, w2, s2, weights, ids, expected = fp8_expert_case(2, 8, 2, D, I, block, seeds=(3, 4, 5),
                                                                  experts=list(range(1, 8)))
    assert rel_err(decode_experts(x, w13, w2, weights, ids, s13, s2, block, tiles=tiles), expected) < 1e-5
    w13_hp, w2_hp = dequantize_fp8(w13, s13, block), dequantize_fp8(w2, s2, block)
    with_shared = expected + naive_experts(x, w13_hp, w2_hp, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int64))
    out = decode_experts(x, w13_hp, w2_hp, weights, ids, shared=(w13_hp[0], w2_hp[0]), tiles=tiles)
    assert rel_err(out, with_shared) < 1e-5


@pytest.mark.parametrize("tile", FP8_GEMV_TILES)
@pytest.mark.parametrize("N,K,block", [(70, 130, (128, 128)), (129, 257, (32, 64)), (256, 2048, (128, 128)),
                                       (40, 200, (16, 24))])
def test_fp8_gemv_matches_twin_at_every_tile(N, K, block, tile):
    """One token, every candidate tile run directly (the interpreter autotunes nothing): tiles inside one row of
    scale blocks (the scales folded into x) and tiles across them (a scale per weight), ragged N and K."""
    q, scale = quantized((N, K), block, N + K)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(N))
    assert rel_err(fp8_gemv(x, q, scale, block, tile), naive_fp8_linear(x, q, scale, block)) < 1e-5


def test_fp8_gemv_reads_a_strided_row():
    """A token row of a split's view (row stride past K) equals the twin."""
    block = (128, 128)
    q, scale = quantized((96, 300), block, 9)
    x = torch.randn(1, 2, 300, generator=torch.Generator().manual_seed(9))[:, 1]
    assert rel_err(fp8_gemv(x, q, scale, block), naive_fp8_linear(x, q, scale, block)) < 1e-5


# Norms inside FP8 GEMVs (kernels.norm_gemv with SCALED). bf16 activations: the interpreter truncates where the GPU
# rounds (tests/kernels/test_triton_interpreted.py says why the bounds are looser here than in tests/gpu).
@pytest.mark.parametrize("tile", [(4, 1024), (16, 512), (64, 128)])  # inside one row of scale blocks, and across
@pytest.mark.parametrize("T,D,N,block", [(1, 300, 70, (128, 128)), (1, 256, 130, (32, 64)), (2, 200, 40, (16, 24))])
def test_add_norm_fp8_gemv_matches_norm_then_dequantized_linear(T, D, N, block, tile):
    case = norm_gemv_inputs(T, D, N, torch.bfloat16, seed=T + D + N)
    q, scale = quantized((N, D), block, N)
    args = case["x"], case["residual"], case["norm_weight"], case["eps"], q
    y, s, h = add_norm_gemv(*args, store_normed=True, tile=tile, scale_inv=scale, block=block)
    y_twin, s_twin, h_twin = naive_add_norm_linear(*args, scale_inv=scale, block=block)
    assert y.dtype == torch.bfloat16 and y.shape == (T, N)
    assert within_ulps(s, s_twin) and within_ulps(h, h_twin, ulps=4)  # h stored before the scales are folded in
    assert rel_err(y, y_twin) < 2e-2


@pytest.mark.parametrize("tile", [(8, 256), (4, 1024), (32, 512)])
@pytest.mark.parametrize("H,K,N,block", [(4, 128, 70, (128, 128)), (3, 64, 129, (32, 64)), (5, 16, 33, (16, 24))])
def test_gated_norm_fp8_gemv_matches_gated_norm_then_dequantized_linear(H, K, N, block, tile):
    case = norm_gemv_inputs(1, K, N, torch.bfloat16, seed=H * K + N, gated_heads=H)
    q, scale = quantized((N, H * K), block, N + 1)
    args = case["o"], case["gate"], case["norm_weight"], case["eps"], q
    y = gated_norm_gemv(*args, tile=tile, scale_inv=scale, block=block)
    assert y.dtype == torch.bfloat16 and y.shape == (1, N)
    assert rel_err(y, naive_gated_norm_linear(*args, scale_inv=scale, block=block)) < 2e-2


def test_fp8_norm_gemv_refuses_missing_or_misshapen_scales():
    case = norm_gemv_inputs(1, 64, 8, torch.bfloat16, seed=3)
    q, scale = quantized((8, 64), (16, 16), 3)
    args = case["x"], case["residual"], case["norm_weight"], case["eps"], q
    with pytest.raises(AssertionError, match="need their block scales"):
        add_norm_gemv(*args)
    with pytest.raises(AssertionError, match="do not fit"):
        add_norm_gemv(*args, scale_inv=scale[:, :2].contiguous(), block=(16, 16))
    with pytest.raises(AssertionError, match="FP8 weights only"):
        add_norm_gemv(*args[:4], case["weight"], scale_inv=scale, block=(16, 16))
