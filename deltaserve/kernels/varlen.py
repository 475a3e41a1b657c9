"""Packed sequences as the GPU kernels take them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @staticmethod
    def build(state_slots: list[int], cu_seqlens: list[int], device: torch.device) -> PackedSeqs:
        cpu = torch.tensor(cu_seqlens, dtype=torch.int64)
        return PackedSeqs(torch.tensor(state_slots, dtype=torch.int64, device=device), cpu.to(device), cpu,
                          max((b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])), default=0))
