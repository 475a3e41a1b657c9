"""RMSNorm and the gated RMSNorm of KDA's output, with the reference's order of operations.

Both keep the statistics in float32 whatever the input dtype (the bfloat16 regime of DESIGN.md section 4)."""

import functools

import torch
import torch.nn.functional as F


def triton_on_gpu(same_dtypes: bool):
    """fn, or on a CUDA tensor its Triton twin of the same name in kernels.triton_norm (one launch where the eager
    chain is ~6; imported at first use: Triton is needed there only), where its tensors share one dtype if
    same_dtypes (the kernel's rounding of a mixed product would not be the eager one's). fn stays the spec, as
    .eager."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args):
            if not args[0].is_cuda:  # every norm of a CPU decode step: one attribute read here
                return fn(*args)
            if same_dtypes and len({a.dtype for a in args if isinstance(a, torch.Tensor)}) > 1:
                return fn(*args)
            from deltaserve.kernels import triton_norm

            return getattr(triton_norm, fn.__name__)(*args)

        wrapper.eager = fn
        return wrapper

    return decorate


@triton_on_gpu(same_dtypes=True)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype; normalised in float32, scaled after the cast back."""
    if _cpu_float32(x, weight):
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    dtype = x.dtype
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(dtype)


@triton_on_gpu(same_dtypes=True)
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the residual add in x's dtype, as the reference does it."""
    x = x + residual
    return rms_norm.eager(x, weight, eps), x


@triton_on_gpu(same_dtypes=False)
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
