"""RMSNorm and the gated RMSNorm of KDA's output, with the reference's order of operations.

Both keep the statistics in float32 whatever the input dtype (the bfloat16 regime of DESIGN.md section 4)."""

import torch
import torch.nn.functional as F

from deltaserve.kernels.fusion import fused_on_gpu


@fused_on_gpu
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype; normalised in float32, scaled after the cast back."""
    if _cpu_float32(x, weight):
        return F.rms_norm(x, x.shape[-1:], weight, eps)
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
    if _cpu_float32(x, gate, weight):
        return F.rms_norm(x, x.shape[-1:], weight, eps) * torch.sigmoid(gate)
    dtype = x.dtype
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    y = weight.float() * (xf * torch.rsqrt(variance + eps))
    return (y * torch.sigmoid(gate.float())).to(dtype)


def _cpu_float32(*tensors: torch.Tensor) -> bool:
    """Whether PyTorch's own rms_norm may stand in: on the CPU in float32 it runs the very ops written here (pow, mean,
    add eps, rsqrt, two products), so the same bits, in one call instead of ~10 (a decode step's cost is per op)."""
    return all(t.dtype == torch.float32 and not t.is_cuda for t in tensors)
