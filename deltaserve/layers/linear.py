import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """A bias-free projection y = x W^T; W [out_features, in_features]. Merged projections are several
    checkpoint tensors stacked along out_features (the loader fills the rows).

    On a GPU, one token against a large half-precision weight runs through our GEMV kernel (kernels.gemv: one
    launch at near the copy bandwidth, where cuBLAS splits K over two kernels); gemv=False keeps cuBLAS (lm_head,
    which cuBLAS streams faster)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None, gemv: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and x.is_cuda:
            from deltaserve.kernels.gemv import gemv, use_gemv

            if use_gemv(x, self.weight):
                return gemv(x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight)
