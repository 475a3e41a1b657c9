"""The feed-forward blocks: dense SwiGLU and the routed MoE with its shared expert."""

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.kernels.moe import fused_experts, grouped_topk
from deltaserve.layers.linear import Linear


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up stacked in one projection [2I, D]."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.gate_weight = nn.Parameter(torch.empty(E, D, dtype=torch.float32))  # router stays float32
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32))
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, D))  # per expert: gate (w1) rows, then up (w3) rows
        self.w2 = nn.Parameter(torch.empty(E, D, I))
        self.shared_experts = SwiGLU(D, I * cfg.num_shared_experts) if cfg.num_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> routed experts (scaled) + shared expert (unscaled), [N, D]."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.gate_weight.float())  # [N, E]
        weights, ids = grouped_topk(logits, self.e_score_correction_bias.float(), cfg.num_experts_per_token,
                                    cfg.num_expert_group, cfg.topk_group, cfg.moe_renormalize,
                                    cfg.routed_scaling_factor)
        out = fused_experts(x, self.w13, self.w2, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
