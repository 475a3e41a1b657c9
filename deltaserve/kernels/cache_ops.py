"""Writes into the paged MLA latent cache."""

import torch


def write_latents(cache: torch.Tensor, slot_mapping: torch.Tensor, latents: torch.Tensor) -> None:
    """cache [P, bs, R+Dr]; slot_mapping [N] int64 (block_id * bs + offset); latents [N, R+Dr] -> in place."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, latents.to(cache.dtype))
