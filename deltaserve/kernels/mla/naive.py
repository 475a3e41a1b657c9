"""The spec of MLA attention: expand every latent, then plain causal softmax attention, one query at a time."""

import torch


def naive_mla(
    q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor, w_kv_b: torch.Tensor, scale: float,
    start_pos: int,
) -> torch.Tensor:
    """q_nope [T, H, Dn], q_rope [T, H, Dr]: queries at positions start_pos..; latents [L, R+Dr] (c_kv, k_rot);
    w_kv_b [H*(Dn+Dv), R]. Returns [T, H, Dv] in float32."""
    T, H, Dn = q_nope.shape
    R = w_kv_b.shape[1]
    kv = (latents[:, :R].float() @ w_kv_b.float().t()).view(latents.shape[0], H, -1)  # [L, H, Dn+Dv]
    k_nope, v = kv[..., :Dn], kv[..., Dn:]
    out = []
    for t in range(T):
        n = start_pos + t + 1
        scores = torch.einsum("hd,lhd->hl", q_nope[t].float(), k_nope[:n])
        scores = scores + q_rope[t].float() @ latents[:n, R:].float().t()
        out.append(torch.einsum("hl,lhd->hd", torch.softmax(scores * scale, dim=-1), v[:n]))
    return torch.stack(out)
