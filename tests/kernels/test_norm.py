"""rms_norm and gated_rms_norm against their formulas, in float32 and in the bfloat16 regime (statistics in
float32, the reference's order of casts)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.norm import gated_rms_norm, rms_norm


def test_rms_norm_float32_is_the_formula():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 24, generator=gen) * 3, torch.randn(24, generator=gen)
    expected = weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 256), (5, 24), (2, 3, 64)])
def test_float32_norms_are_bitwise_the_written_out_ops(shape):
    """On the CPU in float32 both norms run through PyTorch's rms_norm: the same bits as the reference's ops."""
    gen = torch.Generator().manual_seed(4)
    x, gate = torch.randn(shape, generator=gen) * 3, torch.randn(shape, generator=gen)
    weight = torch.randn(shape[-1], generator=gen)
    normed = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(rms_norm(x, weight, 1e-5), normed)
    assert torch.equal(gated_rms_norm(x, gate, weight, 1e-5), normed * torch.sigmoid(gate))


def test_rms_norm_eps_matters_for_small_inputs():
    x, weight = torch.full((1, 4), 1e-3), torch.ones(4)
    assert rms_norm(x, weight, 1e-6)[0, 0].item() == pytest.approx(1e-3 / (1e-6 + 1e-6) ** 0.5, rel=1e-5)
    assert rms_norm(x, weight, 1e-5)[0, 0].item() == pytest.approx(1e-3 / (1e-6 + 1e-5) ** 0.5, rel=1e-5)


def test_rms_norm_bfloat16_normalises_in_float32_and_casts_before_the_weight():
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 32, generator=gen) * 50).bfloat16()
    weight = torch.randn(32, generator=gen).bfloat16()
    xf = x.float()
    expected = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    out = rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_is_the_formula_in_float32(dtype):
    gen = torch.Generator().manual_seed(2)
    x, gate = torch.randn(3, 2, 16, generator=gen).to(dtype), torch.randn(3, 2, 16, generator=gen).to(dtype)
    weight = torch.randn(16, generator=gen)
    xf = x.float()
    expected = weight * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * torch.sigmoid(gate.float())
    out = gated_rms_norm(x, gate, weight, 1e-5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected.to(dtype), rtol=1e-6, atol=1e-6)

