"""FP8 weights, applied to a built model (gpt-fast's habit, so the model file stays clean): the chosen Linear layers
become Fp8Linear and the routed experts' w13 and w2 float8_e4m3fn with block scales.

Quantized: KDA's and MLA's in_proj and o_proj, the dense MLP, the shared and routed experts: all but ~1% of the
weights. High precision: the embedding, lm_head, norms, the router, KDA's conv, A_log, dt_bias and its small gate
up-projections fg_b_proj (feeding the decay exponent), and MLA's kv_b_proj (small; folded into decode's query)."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.config import QuantConfig
from deltaserve.kernel_options import KernelOptions
from deltaserve.kernels.quant import FP8, fp8_linear, scale_shape
from deltaserve.layers.linear import Linear
from deltaserve.layers.moe import MoE

QUANTIZED_LINEARS = ("self_attn.in_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
                     "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj")


class Fp8Linear(nn.Module):
    """y = x W^T with W [out_features, in_features] held as float8_e4m3fn `weight` times float32 block scales
    `weight_scale_inv` [ceil(out/bn), ceil(in/bk)] (the hub's names)."""

    kernels = KernelOptions()  # the engine's choice, set on the built model (KimiLinearForCausalLM.set_kernel_options)

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int]):
        super().__init__()
        self.block = block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape(self.weight.shape, block)), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.kernels.pdl)


def quantize_model(model: nn.Module, quant: QuantConfig) -> None:
    """Swap in FP8 parameters (uninitialised, on the parameters' device; build on meta, then load) in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear) and name.split(".", 2)[-1] in QUANTIZED_LINEARS:
            parent, leaf = name.rsplit(".", 1)
            out_features, in_features = module.weight.shape
            with torch.device(module.weight.device):
                setattr(model.get_submodule(parent), leaf, Fp8Linear(in_features, out_features, quant.block_size))
        elif isinstance(module, MoE):
            module.block = quant.block_size
            for leaf in ("w13", "w2"):
                weight = getattr(module, leaf)
                setattr(module, leaf, nn.Parameter(torch.empty_like(weight, dtype=FP8), requires_grad=False))
                scales = torch.empty(scale_shape(weight.shape, quant.block_size), device=weight.device)
                module.register_parameter(leaf + "_scale_inv", nn.Parameter(scales, requires_grad=False))
