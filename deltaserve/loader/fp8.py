"""FP8 weights at load time: the block-scaled parameters of a quantized model, from an FP8 checkpoint (its
`X_scale_inv` tensors follow X through the name mapping of names.py) or quantized from a high-precision one.

A quantized parameter is assembled whole (float8_e4m3fn values and float32 block scales, on its device), then
this rank's part is taken (sharding.shard_fp8). From an FP8 checkpoint whose tensors each fill whole blocks of the
parameter, values and scales are copied as stored; otherwise the parameter is built in float32 (FP8 tensors
dequantized) and quantized in its own block grid."""

from __future__ import annotations

import logging

import torch

from deltaserve.kernels.quant import FP8, dequantize_fp8, quantize_fp8, scale_shape
from deltaserve.loader.checkpoint import Checkpoint, CheckpointError
from deltaserve.loader.names import Option

log = logging.getLogger("deltaserve")


def scale_name(name: str) -> str:
    """The block scales of checkpoint tensor `name` (X.weight -> X.weight_scale_inv, experts.gate_up_proj ->
    experts.gate_up_proj_scale_inv: the hub's and transformers' names)."""
    return name + "_scale_inv"


def read_fp8(checkpoint: Checkpoint, name: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 checkpoint tensor and its block scales (float32), checked against each other."""
    q, scale = checkpoint.read(name), checkpoint.read(scale_name(name))
    if q.dtype != FP8:
        raise CheckpointError(f"tensor {name} in {checkpoint.file_of[name]} is {q.dtype} but has block scales "
                              f"{scale_name(name)}: FP8 tensors must be float8_e4m3fn; the checkpoint is malformed")
    expected = scale_shape(q.shape, block)
    if tuple(scale.shape) != expected:
        raise CheckpointError(f"tensor {scale_name(name)} in {checkpoint.file_of[scale_name(name)]} has shape "
                              f"{list(scale.shape)}, expected {list(expected)} for {name} {list(q.shape)} in blocks "
                              f"of {list(block)}; config.json's quantization_config.weight_block_size does not match "
                              "the weights")
    if not scale.is_floating_point():
        raise CheckpointError(f"tensor {scale_name(name)} is {scale.dtype}: block scales must be floating point")
    return q, scale.float()


def read_high_precision(checkpoint: Checkpoint, name: str, block: tuple[int, int] | None) -> torch.Tensor:
    """A checkpoint tensor as stored, or dequantized to float32 when the checkpoint holds it in FP8."""
    if block is not None and scale_name(name) in checkpoint.names():
        return dequantize_fp8(*read_fp8(checkpoint, name, block), block)
    tensor = checkpoint.read(name)
    if tensor.dtype == FP8:
        raise CheckpointError(f"tensor {name} in {checkpoint.file_of[name]} is float8_e4m3fn but the checkpoint "
                              f"has no {scale_name(name)} (or config.json has no quantization_config); add the "
                              "scales or use a high-precision checkpoint")
    return tensor


def assemble_fp8(param: str, option: Option, full_shape: torch.Size, checkpoint: Checkpoint,
                 block: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole of a quantized parameter from its checkpoint pieces: (values float8_e4m3fn [full_shape], block
    scales float32 [scale_shape(full_shape)]) on device."""
    stored = [scale_name(p.name) in checkpoint.names() for p in option]
    aligned = all(_block_index(p.index, full_shape, block) is not None for p in option)
    if all(stored) and aligned:
        values = torch.empty(full_shape, dtype=FP8, device=device)
        scales = torch.empty(scale_shape(full_shape, block), device=device)
        for piece in option:
            q, scale = read_fp8(checkpoint, piece.name, block)
            target = values[piece.index] if piece.index else values
            target.copy_(q.reshape(target.shape))
            target_scales = scales[_block_index(piece.index, full_shape, block)]
            target_scales.copy_(scale.reshape(target_scales.shape))
        return values, scales
    if any(stored):
        log.warning("%s: its FP8 checkpoint tensors do not fill whole %s blocks of the parameter; they are "
                    "dequantized and quantized again in the parameter's blocks", param, list(block))
    whole = torch.empty(full_shape, dtype=torch.float32, device=device)
    for piece in option:
        target = whole[piece.index] if piece.index else whole
        target.copy_(read_high_precision(checkpoint, piece.name, block).reshape(target.shape))
    if whole.dim() == 2:
        return quantize_fp8(whole, block)
    pairs = [quantize_fp8(expert, block) for expert in whole]  # one expert at a time: float32 temporaries stay small
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def block_extent(dim: int, ndim: int, block: tuple[int, int]) -> int:
    """Elements per block along dim of a weight of ndim dims: block_n on rows, block_k on columns, 1 on the
    leading (expert) dim."""
    return {ndim - 2: block[0], ndim - 1: block[1]}.get(dim, 1)


def _block_index(index: tuple, full_shape: torch.Size, block: tuple[int, int]) -> tuple | None:
    """The block scales a piece filling full[index] covers, or None when it does not fill whole blocks (a piece may
    end on a partial block only at the end of the parameter)."""
    out = []
    for dim, entry in enumerate(index):
        extent = block_extent(dim, len(full_shape), block)
        if isinstance(entry, int):
            out.append(entry)
            continue
        start, stop, _ = entry.indices(full_shape[dim])
        if start % extent or (stop % extent and stop != full_shape[dim]):
            return None
        out.append(slice(start // extent, -(-stop // extent)))
    return tuple(out)
