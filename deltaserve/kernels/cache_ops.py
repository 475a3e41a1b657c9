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


_COPY_CHUNK_BYTES = 256 << 20  # rows gathered at once by copy_rows' torch path (the runner's activation reserve)


def copy_rows(source: torch.Tensor, target: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """target[:, dst[i]] = source[:, src[i]] for every i: source and target [L, S, ...], two tensors, src and dst [N]
    integer slot indices on their device (in range, none in dst twice: not checked). On a GPU, where both tensors
    are there in one dtype with contiguous rows, one Triton kernel reads each row once and writes it once; elsewhere
    (its twin) torch's gather, then scatter, at most _COPY_CHUNK_BYTES gathered at a time. No wait for the device
    either way."""
    if (source.is_cuda and target.is_cuda and source.dtype == target.dtype and source[0, 0].is_contiguous()
            and target[0, 0].is_contiguous()):
        from deltaserve.kernels.triton_copy import triton_copy_rows

        triton_copy_rows(source, target, src.long(), dst.long())
        return
    per_pair = source[:, 0].numel() * source.element_size()
    chunk = max(1, _COPY_CHUNK_BYTES // max(per_pair, 1))
    for i in range(0, src.numel(), chunk):
        target[:, dst[i:i + chunk]] = source[:, src[i:i + chunk]]
