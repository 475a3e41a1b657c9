"""Packed sequences as the GPU kernels take them, and host lists sent to the device without a wait."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """values as a tensor on device. To a GPU through pinned memory, without blocking the host: torch.tensor(...,
    device=cuda) copies from pageable memory and waits for the device's queue to drain first (measured: a snapshot
    save inside a decode burst stalled ~2 ms), which would also hold a chained burst's host work behind the burst
    before it."""
    if torch.device(device).type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass(frozen=True)
class PackedSeqs:
    """A step's prefill sequences as tensors: their state slots [B] and cu_seqlens [B+1] (token offsets) on the
    device, cu_seqlens on the host too, and the longest sequence. Made once a step and shared by every layer: a
    host list turned into a device tensor is a copy each time, and fla-core caches what it derives from cu_seqlens
    (its chunk indices) by the tensors' identity, syncing with the device to derive it anew otherwise."""

    state_slots: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    max_len: int
    # [tiles, 2] on the device: (sequence, first token of the tile within it) for every TOKEN_TILE tokens of every
    # sequence, so a kernel over token tiles launches as many programs as there are tiles, however uneven the
    # lengths (a grid of sequences x the longest's tiles was mostly empty programs beside one long chunk)
    token_tiles: torch.Tensor

    @staticmethod
    def build(state_slots: list[int], cu_seqlens: list[int], device: torch.device) -> PackedSeqs:
        cpu = torch.tensor(cu_seqlens, dtype=torch.int64)
        lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
        tiles = [(seq, t) for seq, n in enumerate(lengths) for t in range(0, n, TOKEN_TILE)]
        return PackedSeqs(to_device(state_slots, torch.int64, device), to_device(cu_seqlens, torch.int64, device), cpu,
                          max(lengths, default=0), to_device(tiles, torch.int64, device).view(-1, 2))


TOKEN_TILE = 32  # tokens a tile of PackedSeqs.token_tiles (kernels.conv1d_triton's prefill conv)
