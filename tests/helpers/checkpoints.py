"""Small deltaserve checkpoints written without the reference, and ways to rewrite them (shards, edits)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltaserve.config import ModelConfig, QuantConfig
from deltaserve.kernels.quant.naive import naive_quantize
from deltaserve.loader.model_loader import build_model, init_dummy_weights
from deltaserve.loader.writer import save_checkpoint

# a verbatim copy of ../shared/models/kimi-linear-48b-a3b/config.json (tests/test_config.py checks it still is)
CONFIG_48B = Path(__file__).resolve().parent / "kimi_linear_48b_config.json"

SMALL_RAW_CONFIG = {  # Moonshot's spelling; layers: KDA (dense MLP), MLA (MoE), KDA (MoE)
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 128, "hidden_size": 32,
    "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2,
    "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "model_max_length": 4096, "q_lora_rank": None,
    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "mla_use_nope": True,
    "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446,
    "num_expert_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2], "num_heads": 2, "head_dim": 8,
                           "short_conv_kernel_size": 4},
}


def small_model(seed: int = 0, raw: dict | None = None):
    """(raw config, ModelConfig, float32 CPU model with random non-degenerate weights)."""
    raw = dict(raw or SMALL_RAW_CONFIG)
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, torch.float32, "cpu")
    init_dummy_weights(model, seed, std=0.1)
    return raw, cfg, model


def write_small_checkpoint(folder: Path, layout: str = "moonshot", seed: int = 0) -> Path:
    raw, cfg, model = small_model(seed)
    save_checkpoint(model, cfg, raw, folder, layout)
    return Path(folder)


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a single-file checkpoint."""
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def rewrite_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(Path(folder) / "model.safetensors"),
              metadata={"format": "pt"})


def shard(folder: Path, num_shards: int) -> dict[str, str]:
    """Split folder's model.safetensors into num_shards files + model.safetensors.index.json, as transformers
    names them; returns the weight map."""
    tensors = read_tensors(folder)
    (Path(folder) / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, str(Path(folder) / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (Path(folder) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return weight_map


_NOT_QUANTIZED = re.compile(r"embed_tokens|lm_head|conv1d|\.gate\.weight$")  # as FP8 checkpoints on the hub


def write_fp8_checkpoint(src: Path, dst: Path, quant: QuantConfig) -> Path:
    """A copy of the high-precision checkpoint `src` the way the hub's FP8 checkpoints are made: every linear
    weight and stacked expert tensor (2-D or 3-D, but the embedding, lm_head, convs, the router and
    quant.modules_to_not_convert) quantized block by block with the naive quantizer, beside its X_scale_inv;
    config.json gains the matching quantization_config."""
    tensors = {}
    for name, tensor in read_tensors(src).items():
        if tensor.dim() in (2, 3) and not _NOT_QUANTIZED.search(name) and not quant.keeps_high_precision(name):
            pairs = [naive_quantize(t, quant.block_size) for t in tensor.reshape(-1, *tensor.shape[-2:])]
            tensors[name] = torch.stack([q for q, _ in pairs]).reshape(tensor.shape)
            tensors[name + "_scale_inv"] = torch.stack([s for _, s in pairs]).reshape(
                *tensor.shape[:-2], *pairs[0][1].shape)
        else:
            tensors[name] = tensor
    Path(dst).mkdir(parents=True, exist_ok=True)
    rewrite_tensors(dst, tensors)
    raw = json.loads((Path(src) / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(quant.block_size),
                                  "modules_to_not_convert": list(quant.modules_to_not_convert)}
    (Path(dst) / "config.json").write_text(json.dumps(raw, indent=2))
    return Path(dst)
