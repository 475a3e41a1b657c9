import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """A bias-free projection y = x W^T; W [out_features, in_features]. Merged projections are several
    checkpoint tensors stacked along out_features (the loader fills the rows)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
