"""Writes into the paged MLA latent cache."""

import torch

from deltaserve.kernels.quant import FP8, FP8_MAX


def write_latents(cache: torch.Tensor, slot_mapping: torch.Tensor, latents: torch.Tensor) -> None:
    """cache [P, bs, R+Dr]; slot_mapping [N] int64 (block_id * bs + offset); latents [N, R+Dr] -> in place, in
    the cache's dtype (float8: clamped to its range, and copied as bytes, which every device's index_copy_ takes)."""
    if cache.dtype == FP8:
        cache, latents = cache.view(torch.uint8), to_latent_cache(latents).view(torch.uint8)
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, latents.to(cache.dtype))


def to_latent_cache(latents: torch.Tensor) -> torch.Tensor:
    """latents as a float8 latent cache stores them: clamped to +-448 (e4m3's largest), rounded to float8."""
    if latents.dtype == FP8:
        return latents
    return latents.clamp(-FP8_MAX, FP8_MAX).to(FP8)
