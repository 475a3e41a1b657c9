"""SwiGLU's activation: silu(gate) * up for the gate and up halves of one projection's output."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate columns, then up) -> silu(gate) * up [..., I] in x's dtype. On a GPU in half precision one
    Triton kernel (kernels.triton_activation: float32 inside, rounded once; PyTorch's two ops each round and write a
    tensor, and F.silu reads the gate half strided); elsewhere PyTorch's ops, the reference's (float32 exact). This
    torch code is the kernel's twin."""
    if x.is_cuda and x.dtype != torch.float32:
        from deltaserve.kernels.triton_activation import triton_silu_and_mul  # Triton: imported on a GPU only

        return triton_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
