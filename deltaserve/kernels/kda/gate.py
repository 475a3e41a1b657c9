"""The elementwise parts of KDA: the forget gate in log space and FLA's l2norm."""

import torch
import torch.nn.functional as F


def kda_gate(g_raw: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor) -> torch.Tensor:
    """g_raw [N, H*K] (f_b_proj output), dt_bias [H*K], a_log [H] -> log decay g [N, H, K] float32, <= 0:
    -exp(A_log[h]) * softplus(g_raw + dt_bias), softplus linear above 20 as in the reference."""
    H = a_log.numel()
    g = F.softplus(g_raw.float() + dt_bias.float(), threshold=20.0)
    return -a_log.float().exp()[:, None] * g.view(g.shape[0], H, -1)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32: FLA's form (not F.normalize's max(norm, eps))."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)
