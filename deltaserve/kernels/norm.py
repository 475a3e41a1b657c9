"""RMSNorm and the gated RMSNorm of KDA's output, with the reference's order of operations.

Both keep the statistics in float32 whatever the input dtype (the bfloat16 regime of DESIGN.md section 4).
"""

import torch

from deltaserve.kernels.fusion import fused_on_gpu


@fused_on_gpu
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype; normalised in float32, scaled after the cast back."""
    dtype = x.dtype
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(dtype)


@fused_on_gpu
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the residual add in x's dtype, as the reference does it."""
    x = x + residual
    return rms_norm.eager(x, weight, eps), x


@fused_on_gpu
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., D], weight [D] -> rmsnorm(x) * weight * sigmoid(gate), all in float32, cast to x's dtype."""
    dtype = x.dtype
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    y = weight.float() * (xf * torch.rsqrt(variance + eps))
    return (y * torch.sigmoid(gate.float())).to(dtype)
