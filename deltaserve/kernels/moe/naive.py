"""The spec of the MoE ops: the router written out per token and expert compute one (token, expert) at a time."""

import torch
import torch.nn.functional as F


def naive_grouped_topk(router_logits, correction_bias, top_k, num_groups, topk_group, renormalize, scaling_factor):
    """Same contract as kernels.moe.routing.grouped_topk, one token at a time with Python sorting."""
    T, E = router_logits.shape
    per_group = E // num_groups
    all_weights, all_ids = [], []
    for t in range(T):
        scores = torch.sigmoid(router_logits[t].float()).tolist()
        biased = [s + float(b) for s, b in zip(scores, correction_bias.tolist())]
        groups = sorted(range(num_groups), key=lambda gi: -sum(
            sorted(biased[gi * per_group:(gi + 1) * per_group], reverse=True)[:2]))[:topk_group]
        allowed = [e for gi in groups for e in range(gi * per_group, (gi + 1) * per_group)]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:top_k]
        w = [scores[e] for e in chosen]
        total = sum(w) + 1e-20 if renormalize else 1.0
        all_weights.append([wi / total * scaling_factor for wi in w])
        all_ids.append(chosen)
    return torch.tensor(all_weights), torch.tensor(all_ids)


def naive_experts(x, w13, w2, weights, ids):
    """Same contract as kernels.moe.experts.fused_experts, one (token, expert) pair at a time, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            out[t] += weights[t, j].float() * (w2[e].float() @ (F.silu(gate) * up))
    return out
