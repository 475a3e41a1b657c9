import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.kernel_options import KernelOptions
from deltaserve.kernels import cpu_gemv


class Linear(nn.Module):
    """A bias-free projection y = x W^T; W [out_features, in_features]. Merged projections are several
    checkpoint tensors stacked along out_features (the loader fills the rows).

    On a GPU, one token against a large half-precision weight runs through our GEMV kernel (kernels.gemv: one
    launch at near the copy bandwidth, where cuBLAS splits K over two kernels); gemv=False keeps cuBLAS (lm_head,
    which cuBLAS streams faster). On the CPU, up to 4 float32 rows run through kernels.cpu_gemv where it is built
    and the engine's KernelOptions allow it."""

    kernels = KernelOptions()  # the engine's choice, set on the built model (KimiLinearForCausalLM.set_kernel_options)

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None, gemv: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return cpu_gemv.linear(x, self.weight, cpu_gemv_threads(self.kernels))
        if self.gemv:
            from deltaserve.kernels.gemv import gemv, use_gemv

            if use_gemv(x, self.weight):
                return gemv(x.reshape(-1, x.shape[-1]), self.weight, pdl=self.kernels.pdl).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight)


def cpu_gemv_threads(kernels: KernelOptions) -> int | None:
    """The threads of kernels.cpu_gemv's products (its functions' argument), None where the engine turned it off."""
    return kernels.cpu_threads if kernels.cpu_gemv else None


def norm_gemv_kernels(x: torch.Tensor, kernels: KernelOptions):
    """The module kernels.norm_gemv (norms inside the GEMVs that read them) where its kernels may serve x's step (a
    GPU, and KernelOptions.norm_gemv; imported here, since it needs Triton), else None. The layers ask this one
    function, so a test can stand the kernels' twins in for them on the CPU."""
    if not x.is_cuda or not kernels.norm_gemv:
        return None
    from deltaserve.kernels import norm_gemv

    return norm_gemv


def gemv_weight(proj: nn.Module, x: torch.Tensor) -> dict | None:
    """A projection's weight as kernels.norm_gemv's wrappers take it: a plain Linear's of x's dtype, or an FP8
    layer's (layers.fp8.Fp8Linear: its float8 weight, block scales and block); None for any other projection (those
    keep their norm apart)."""
    if type(proj) is Linear:
        return {"weight": proj.weight} if proj.weight.dtype == x.dtype else None
    if hasattr(proj, "weight_scale_inv"):
        return {"weight": proj.weight, "scale_inv": proj.weight_scale_inv, "block": proj.block}
    return None


def norm_then_project(norm, proj: Linear, x: torch.Tensor, residual: torch.Tensor | None, kernels: KernelOptions):
    """(proj(h), s) for (h, s) = norm(x, residual) (s = x when residual is None): a decoder layer's input norm and
    its attention's first projection. For one token on a GPU with the residual add, one kernel
    (kernels.norm_gemv.add_norm_gemv: the norm inside the projection's GEMV, a launch less a layer; bf16 or FP8
    weights)."""
    if residual is None:
        return proj(norm(x)), x
    fused = norm_gemv_kernels(x, kernels)
    weight = gemv_weight(proj, x)
    if fused is not None and weight is not None \
            and fused.fits(x, norm.weight, weight["weight"], fused.NORM_GEMV_MAX_TOKENS, residual):
        y, residual, _ = fused.add_norm_gemv(x, residual, norm.weight, norm.eps, **weight, pdl=kernels.pdl)
        return y, residual
    h, residual = norm(x, residual)
    return proj(h), residual
