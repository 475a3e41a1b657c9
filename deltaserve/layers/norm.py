import torch
from torch import nn

from deltaserve.kernels.norm import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rmsnorm(x); with residual: (rmsnorm(x + residual), x + residual), one fused kernel on a GPU."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
