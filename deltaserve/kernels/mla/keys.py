"""MLA prefill's keys: each head's expanded k_nope beside the one k_rope its token shares across heads.

Prefill attention takes keys [L, H, Dn+Dr]; kv_b_proj gives k_nope inside its [L, H, Dn+Dv] output and the latent
gives k_rope [L, Dr]. On a GPU in half precision one Triton pass writes the keys (kernels.mla.triton_keys);
torch.cat of a broadcast k_rope runs PyTorch's non-vectorised copy there (a third of the card's copy bandwidth), and
a long prefill expands every cached key once a chunk. The torch path below is its twin (the exact regime's prefill
expands its keys apart, in the reference's order: layers.mla's _expand)."""

import torch


def expand_keys(k_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """k_nope [L, H, Dn] (a strided view of kv_b_proj's output is fine), k_rope [L, Dr] -> keys [L, H, Dn+Dr]
    contiguous, k_nope's dtype: each head's k_nope, then the token's k_rope."""
    if k_nope.is_cuda and k_nope.dtype != torch.float32:
        from deltaserve.kernels.mla.triton_keys import triton_expand_keys  # Triton: imported on a GPU only

        return triton_expand_keys(k_nope, k_rope)
    return torch.cat([k_nope, k_rope[:, None, :].expand(-1, k_nope.shape[1], -1)], dim=-1)
