"""Write a model's parameters as a checkpoint in one of the three layouts of DESIGN.md section 2.

The inverse of the loader, driven by the same name table (loader/names.py): per parameter, the option whose
tensor names belong to the layout is chosen and each piece is cut out of the parameter."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from deltaserve.config import ModelConfig
from deltaserve.loader.names import checkpoint_options

LAYOUTS = ("moonshot", "saved", "transformers")
_GATE_PARAM = re.compile(r"\.(f_a_proj|f_b_proj|dt_bias|A_log)")
_MOE_PIECE = re.compile(r"\.(gate\.|experts|shared_experts)")


def _belongs(name: str, layout: str) -> bool:
    """Whether a checkpoint tensor name is spelled the way `layout` spells it."""
    if layout == "transformers":
        return ("block_sparse_moe" not in name and not re.search(r"experts\.\d", name) and "_conv1d" not in name
                and (not _GATE_PARAM.search(name) or "forget_gate" in name))
    if "forget_gate" in name or ".conv1d." in name or ".experts.gate_up_proj" in name or ".experts.down_proj" in name:
        return False
    mlp_like = ".mlp." in name or ".block_sparse_moe." in name
    wants_moe_prefix = layout == "saved" or _MOE_PIECE.search(name)
    return not mlp_like or (".block_sparse_moe." in name) == bool(wants_moe_prefix)


def checkpoint_tensors(model: torch.nn.Module, cfg: ModelConfig, layout: str) -> dict[str, torch.Tensor]:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: must be one of {', '.join(LAYOUTS)}")
    params = dict(model.named_parameters())
    tensors = {}
    for param, options in checkpoint_options(cfg).items():
        option = next(o for o in options if all(_belongs(p.name, layout) for p in o))
        for piece in option:
            value = params[param].data[piece.index] if piece.index else params[param].data
            tensors[piece.name] = value.reshape(piece.shape).contiguous().clone()
    return tensors


def save_checkpoint(model: torch.nn.Module, cfg: ModelConfig, raw_config: dict, folder: str | Path,
                    layout: str = "moonshot") -> None:
    """config.json (raw_config, as given) and model.safetensors in `layout`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(model, cfg, layout), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n", encoding="utf-8")
