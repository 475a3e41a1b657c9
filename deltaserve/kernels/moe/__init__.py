from deltaserve.kernels.moe.experts import fused_experts
from deltaserve.kernels.moe.routing import grouped_topk, select_experts

__all__ = ["fused_experts", "grouped_topk", "select_experts"]
