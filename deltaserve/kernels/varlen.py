"""Packed sequences as the GPU kernels take them, and host lists sent to the device without a wait."""

from __future__ import annotations

import array

import torch

from deltaserve.forward_batch import PackedSeqs

TOKEN_TILE = 32  # tokens a tile of PackedSeqs.token_tiles (kernels.conv1d_triton's prefill conv)


# int64 lists at least this long are converted through an array's buffer (a prefill chunk's ids, positions and cache
# slots: ~3x less host time than torch.tensor's parse of each element at 8k tokens)
BUFFER_MIN_LEN = 256


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """values as a tensor on device. To a GPU through pinned memory, without blocking the host: torch.tensor(...,
    device=cuda) copies from pageable memory and waits for the device's queue to drain first, which would also hold
    the host's work for a step behind the step in flight before it."""
    cpu = torch.device(device).type == "cpu"
    if dtype == torch.int64 and len(values) >= BUFFER_MIN_LEN and isinstance(values[0], int):
        host = torch.frombuffer(array.array("q", values), dtype=torch.int64)  # shares the array's memory
        return host if cpu else host.pin_memory().to(device, non_blocking=True)
    if cpu:
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def pack_seqs(state_slots: list[int], cu_seqlens: list[int], device: torch.device) -> PackedSeqs:
    """Sequences given by their state slots [B] and token offsets [B+1] as PackedSeqs on device."""
    cpu = torch.tensor(cu_seqlens, dtype=torch.int64)
    lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    tiles = [(seq, t) for seq, n in enumerate(lengths) for t in range(0, n, TOKEN_TILE)]
    return PackedSeqs(to_device(state_slots, torch.int64, device), to_device(cu_seqlens, torch.int64, device), cpu,
                      max(lengths, default=0), to_device(tiles, torch.int64, device).view(-1, 2))
