"""Block-wise FP8 weights on the CPU: quantize and dequantize against their naive twins (bit for bit) at ragged
shapes, the round trip's error bound, and the CPU fallbacks of the linear layer and the routed experts."""

import pytest
import torch
import torch.nn.functional as F

from deltaserve.kernels.moe import fused_experts
from deltaserve.kernels.moe.naive import naive_experts
from deltaserve.kernels.quant import FP8, FP8_MAX, dequantize_fp8, fp8_fused_experts, fp8_linear, quantize_fp8
from deltaserve.kernels.quant.naive import naive_dequantize, naive_fp8_linear, naive_quantize

# N, K around the 128 blocks (1, block - 1, block, block + 1, several blocks and a ragged tail) and small blocks
SHAPES = [(1, 1), (127, 129), (128, 128), (129, 300), (257, 64)]
BLOCKS = [(128, 128), (16, 24)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def weight(shape, seed: int) -> torch.Tensor:
    """Random weights whose blocks differ in scale by orders of magnitude (some blocks all zero)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[-1])[torch.randperm(shape[-1], generator=gen)]
    w[..., : min(3, shape[-2]), :] = 0.0
    return w


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_quantize_and_dequantize_equal_their_twins_bit_for_bit(N, K, block):
    w = weight((N, K), N * K)
    q, scale = quantize_fp8(w, block)
    q_twin, scale_twin = naive_quantize(w, block)
    assert q.dtype == FP8 and q.shape == (N, K) and scale.shape == (-(-N // block[0]), -(-K // block[1]))
    assert torch.equal(bits(q), bits(q_twin)) and torch.equal(scale, scale_twin)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_fp8(q, scale, block, dtype), naive_dequantize(q, scale, block, dtype))


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_round_trip_error_is_one_e4m3_rounding(N, K, block):
    w = weight((N, K), N + K)
    q, scale = quantize_fp8(w, block)
    full_scale = scale.repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]
    err = (dequantize_fp8(q, scale, block) - w).abs()
    # e4m3: 3 mantissa bits (half an ulp is 2^-4 relative); below 2^-6 subnormals spaced 2^-9 (times the scale)
    assert torch.all(err <= w.abs() * 2 ** -4 + full_scale * 2 ** -10)
    assert q.float().abs().max() <= FP8_MAX


def test_zero_blocks_get_unit_scale_and_zero_values():
    q, scale = quantize_fp8(torch.zeros(130, 5), (128, 128))
    assert torch.equal(scale, torch.ones(2, 1)) and torch.all(q.float() == 0)


def test_leading_expert_dim_has_blocks_of_its_own():
    w = weight((3, 40, 70), 7)
    q, scale = quantize_fp8(w, (16, 32))
    assert scale.shape == (3, 3, 3)
    for e in range(3):
        q_e, s_e = naive_quantize(w[e], (16, 32))
        assert torch.equal(bits(q[e]), bits(q_e)) and torch.equal(scale[e], s_e)
    assert torch.equal(dequantize_fp8(q, scale, (16, 32))[1], naive_dequantize(q[1], scale[1], (16, 32)))


@pytest.mark.parametrize("M", [1, 5, 70])
def test_cpu_linear_is_the_dequantized_weights_matmul(M):
    block = (128, 128)
    q, scale = quantize_fp8(weight((200, 150), M), block)
    x = torch.randn(M, 150, generator=torch.Generator().manual_seed(M))
    assert torch.equal(fp8_linear(x, q, scale, block), F.linear(x, naive_dequantize(q, scale, block)))
    assert torch.allclose(fp8_linear(x, q, scale, block), naive_fp8_linear(x, q, scale, block), atol=1e-5)


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (7, 16, 4), (40, 6, 3)])
def test_cpu_experts_dequantize_only_the_chosen_ones_and_match_the_full_dequantization(T, E, k):
    gen = torch.Generator().manual_seed(T * E)
    D, I, block = 96, 40, (16, 32)  # ragged against the blocks
    w13, s13 = quantize_fp8(torch.randn(E, 2 * I, D, generator=gen) * 0.1, block)
    w2, s2 = quantize_fp8(torch.randn(E, D, I, generator=gen) * 0.1, block)
    x = torch.randn(T, D, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    out = fp8_fused_experts(x, w13, s13, w2, s2, weights, ids, block)
    dense13, dense2 = dequantize_fp8(w13, s13, block), dequantize_fp8(w2, s2, block)
    assert torch.equal(out, fused_experts(x, dense13, dense2, weights, ids))
    assert torch.allclose(out, naive_experts(x, dense13, dense2, weights, ids), atol=1e-5)
