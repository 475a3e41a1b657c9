"""Kimi-Linear's router: sigmoid scores, bias-corrected grouped top-k selection, unbiased renormalised weights."""

import torch


def grouped_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_group: int,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] float32, correction_bias [E] float32 -> weights [T, top_k] float32, ids [T, top_k] int64.

    The bias only chooses: a group scores the sum of its top-2 biased scores, the best topk_group groups stay,
    the top_k biased scores among them are picked, and their *unbiased* sigmoid scores become the weights."""
    scores = router_logits.sigmoid()
    biased = scores + correction_bias
    T, E = biased.shape
    if topk_group < num_groups:  # otherwise every group stays: the mask would keep everything
        group_scores = biased.view(T, num_groups, E // num_groups).topk(2, dim=-1)[0].sum(-1)  # [T, G]
        group_ids = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand(T, num_groups, E // num_groups).reshape(T, E)
        biased = biased.masked_fill(~expert_mask, float("-inf"))
    ids = biased.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


def select_experts(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, num_groups: int,
                   topk_group: int, renormalize: bool, scaling_factor: float,
                   exact: bool, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_topk; on a GPU, where no group is masked and the run is not the exact (float32) regime, its one-kernel
    twin (kernels.moe.triton_routing: the same choice, sigmoid to within rounding; pdl: its launch, kernels.pdl)."""
    if router_logits.is_cuda and not exact and topk_group >= num_groups:
        from deltaserve.kernels.moe.triton_routing import triton_topk

        return triton_topk(router_logits, correction_bias, top_k, renormalize, scaling_factor, pdl)
    return grouped_topk(router_logits, correction_bias, top_k, num_groups, topk_group, renormalize, scaling_factor)
