"""Build the model on the meta device, then fill it from a checkpoint (one tensor at a time) or with dummy weights."""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.distributed import SINGLE, ParallelConfig
from deltaserve.kernels.quant import FP8, FP8_MAX
from deltaserve.layers.fp8 import quantize_model
from deltaserve.loader.checkpoint import Checkpoint, CheckpointError, all_finite
from deltaserve.loader.fp8 import assemble_fp8, block_extent, read_high_precision, scale_name
from deltaserve.loader.names import FLOAT32_PARAMS, Option, checkpoint_options
from deltaserve.loader.sharding import copy_piece, shard_fp8, shard_specs
from deltaserve.models.kimi_linear import KimiLinearForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "meta",
                parallel: ParallelConfig = SINGLE) -> KimiLinearForCausalLM:
    """The model (this rank's shard of it) with uninitialised parameters on `device` (meta: no memory), in dtype
    but FLOAT32_PARAMS; with cfg.quantization, its linear layers and experts in FP8 (layers/fp8.py)."""
    with torch.device("meta"):
        model = KimiLinearForCausalLM(cfg, parallel)
    for name, param in model.named_parameters():
        param.data = param.data.to(torch.float32 if name.rsplit(".", 1)[-1] in FLOAT32_PARAMS else dtype)
    if cfg.quantization is not None:
        quantize_model(model, cfg.quantization)
    if str(device) == "meta":
        return model
    try:
        # model.to_empty(device), but through torch.empty: empty_like of a meta tensor runs PyTorch's Python
        # reference, whose first call imports sympy (a second of every start-up)
        return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    except RuntimeError as e:  # torch.OutOfMemoryError is one; the CPU allocator raises a plain RuntimeError
        if not isinstance(e, torch.OutOfMemoryError) and "alloc" not in str(e):
            raise
        size = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
        raise ConfigError(f"the model's weights need {size / 1e9:,.1f} GB ({dtype}, sizes from config.json) and "
                          f"{device} cannot allocate them; check config.json's sizes, or use a device with more "
                          "memory") from None


def load_model(folder: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: str,
               progress: Callable[[int, int], None] | None = None,
               parallel: ParallelConfig = SINGLE) -> KimiLinearForCausalLM:
    """The model with its weights from folder; the checkpoint's names, shapes and dtypes are checked against
    config.json before the model takes any memory (a config.json of another model is told as such, not as an
    allocation failure)."""
    checkpoint = Checkpoint(folder)
    plan = plan_weights(checkpoint, cfg)
    model = build_model(cfg, dtype, device, parallel)
    load_weights(model, checkpoint, cfg, plan, progress, parallel)
    return model.eval()


def plan_weights(checkpoint: Checkpoint, cfg: ModelConfig) -> dict[str, Option]:
    """deltaserve parameter name -> the checkpoint tensors it is read from; missing, unexpected and mis-shaped
    tensors are errors."""
    available = checkpoint.names()
    plan = {name: _choose(name, options, available, checkpoint.folder)
            for name, options in checkpoint_options(cfg).items()}
    _check_unexpected(checkpoint, plan, cfg.quantization is not None)
    for name, option in plan.items():
        for piece in option:
            _check_shape(piece, checkpoint.shape(piece.name), checkpoint.file_of[piece.name], name)
    return plan


def load_weights(model, checkpoint: Checkpoint, cfg: ModelConfig, plan: dict[str, Option], progress=None,
                 parallel: ParallelConfig = SINGLE) -> None:
    """Copy every parameter's tensors in (only this rank's part of a sharded one, sliced as it is read), as
    plan_weights chose them. FP8 parameters and checkpoint tensors: see loader/fp8.py."""
    params = dict(model.named_parameters())
    full_shapes = {n: p.shape for n, p in build_model(cfg, torch.float32).named_parameters()}
    shards = shard_specs(cfg, parallel) if parallel.world_size > 1 else {}
    block = cfg.quantization.block_size if cfg.quantization is not None else None
    for step, (name, option) in enumerate(plan.items()):
        if params[name].dtype == FP8:
            _load_fp8(name, params, option, full_shapes[name], shards.get(name), checkpoint, block)
        else:
            for piece in option:
                copy_piece(params[name].data, piece.index, full_shapes[name], shards.get(name),
                           partial(read_high_precision, checkpoint, piece.name, block))
        _check_finite(name, params, option, checkpoint)
        if progress:
            progress(step + 1, len(plan))


def _check_finite(name: str, params: dict, option: Option, checkpoint: Checkpoint) -> None:
    """NaN or Inf in a loaded parameter (its scales too, in FP8) is an error naming the checkpoint tensor. Checked as
    loaded, not as read: one pass over a parameter in hot memory costs a fifth of one per checkpoint tensor (the demo
    model on the CPU: +5% of the load, against +35%); the tensors are read again only to name the bad one."""
    filled = [params[name].data] + ([params[scale_name(name)].data] if params[name].dtype == FP8 else [])
    if all(all_finite(t) for t in filled):
        return
    names = [piece.name for piece in option]
    names += [scale_name(n) for n in names if scale_name(n) in checkpoint.names()]
    checkpoint.check_finite(names, name, params[name].dtype)


def _check_unexpected(checkpoint: Checkpoint, plan: dict[str, Option], quantized: bool) -> None:
    used = {piece.name for option in plan.values() for piece in option}
    if quantized:
        used |= {scale_name(name) for name in used}
    unexpected = sorted(checkpoint.names() - used)
    if unexpected:
        first = unexpected[0]
        hint = (" (FP8 block scales, but config.json has no quantization_config)" if not quantized
                and first.endswith("_scale_inv") else "")
        raise CheckpointError(f"unexpected tensor {first} of shape {list(checkpoint.shape(first))} in "
                              f"{checkpoint.file_of[first]} ({len(unexpected)} unexpected in all){hint}: not a "
                              "Kimi-Linear tensor for this config.json; check that config.json matches the weights")


def _load_fp8(name: str, params: dict, option: Option, full_shape: torch.Size, shard, checkpoint: Checkpoint,
              block: tuple[int, int]) -> None:
    """An FP8 parameter and its block scales (name + "_scale_inv"): assembled whole, then this rank's part."""
    values, scales = params[name].data, params[scale_name(name)].data
    whole_values, whole_scales = assemble_fp8(name, option, full_shape, checkpoint, block, values.device)
    if shard is not None:
        extent = block_extent(shard[0], len(full_shape), block)
        whole_values, whole_scales = shard_fp8(name, whole_values, whole_scales, shard, extent)
    values.copy_(whole_values)
    scales.copy_(whole_scales)


def _choose(param: str, options: list[Option], available: set[str], folder: Path) -> Option:
    """The option whose tensors are all present; else an error naming a tensor of the closest one."""
    for option in options:
        if all(piece.name in available for piece in option):
            return option
    closest = max(options, key=lambda o: sum(piece.name in available for piece in o))
    missing = [piece for piece in closest if piece.name not in available]
    raise CheckpointError(f"missing tensor {missing[0].name} of shape {list(missing[0].shape)} in {folder} (for "
                          f"parameter {param}; {len(missing)} missing for it): the checkpoint is incomplete or its "
                          "config.json describes another model")


def _check_shape(piece, shape: tuple[int, ...], file: str, param: str) -> None:
    squeeze = lambda s: tuple(d for d in s if d != 1)  # noqa: E731  ([H] and [1, 1, H, 1] are the same A_log)
    if squeeze(shape) != squeeze(piece.shape):
        raise CheckpointError(f"tensor {piece.name} in {file} has shape {list(shape)}, expected "
                              f"{list(piece.shape)} (for parameter {param}); config.json does not match the weights")


def init_dummy_weights(model: KimiLinearForCausalLM, seed: int = 0, std: float = 0.02,
                       seed_per_parameter: bool = False) -> None:
    """Random weights of the real shapes, non-degenerate where a bug would hide (decays, biases, norms, convs).
    seed_per_parameter: each parameter from its own seed (seed and name), so that the replicated parameters of
    tensor-parallel ranks, whose sharded ones differ in size, come out equal.

    Routers route like a trained model's, spread over the experts: weights N(0, 1 / hidden), so that a logit
    of an RMS-normed input has std ~1 and the sigmoid scores spread over (0, 1), and a correction bias (std 1e-3)
    that chooses only between near-equal scores (larger weights saturate the sigmoid, and a larger bias then
    chooses the same experts for every token)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if seed_per_parameter:
            gen.manual_seed(seed + zlib.crc32(name.encode()))
        leaf, data = name.rsplit(".", 1)[-1], param.data
        if data.dtype == FP8:  # values N(0, 1) in e4m3, and (below) block scales std: weights N(0, std^2)
            for part in data.view(-1, data.shape[-1]).split(max((1 << 20) // data.shape[-1], 1)):
                part.copy_(torch.randn(part.shape, generator=gen, device=part.device).clamp(-FP8_MAX, FP8_MAX))
        elif leaf.endswith("_scale_inv"):
            data.fill_(std)
        elif leaf == "A_log":
            data.copy_(torch.empty_like(data).uniform_(1.0, 16.0, generator=gen).log())
        elif leaf == "dt_bias":
            dt = torch.empty_like(data).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
            data.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif leaf == "e_score_correction_bias":
            data.normal_(0.0, 1e-3, generator=gen)
        elif data.dim() == 1:  # norm weights around 1
            data.normal_(1.0, 0.1, generator=gen)
        elif leaf == "gate_weight":  # routers: logits of std ~1, far from ties and from saturation
            data.normal_(0.0, data.shape[-1] ** -0.5, generator=gen)
            # values a bfloat16 checkpoint holds (the published config's torch_dtype; layers/moe.py's router GEMM
            # keys on it)
            data.copy_(data.bfloat16().float())
        else:
            data.normal_(0.0, std, generator=gen)
