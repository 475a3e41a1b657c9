"""make-tiny: a small random Kimi-Linear checkpoint with a trained tokenizer, for tests and first runs.

Both kinds of attention, a dense first layer, grouped MoE with a shared expert; random but non-degenerate
(decays, biases, norms and convs all random), so a bug shows in the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deltaserve.config import ModelConfig
from deltaserve.loader.model_loader import build_model, init_dummy_weights
from deltaserve.loader.writer import save_checkpoint
from deltaserve.tokenizer.train import MODEL_MAX_LENGTH, train_tiny_tokenizer

TINY_VOCAB = 512
TINY_LAYERS = ("kda", "kda", "mla", "kda", "mla")


def tiny_raw_config(ids, layout: str) -> dict:
    """config.json of the tiny model: Moonshot's spelling, or the one transformers' save_pretrained writes."""
    raw = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "torch_dtype": "float32",
        "vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 160, "moe_intermediate_size": 32,
        "num_hidden_layers": len(TINY_LAYERS), "num_attention_heads": 4, "num_key_value_heads": 4,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": ids.bos_token_id, "eos_token_id": ids.eos_token_id, "pad_token_id": ids.pad_token_id,
        "model_max_length": MODEL_MAX_LENGTH, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True, "num_experts": 8,
        "num_experts_per_token": 2, "num_shared_experts": 1, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446, "use_grouped_topk": True,
        "num_expert_group": 2, "topk_group": 1,
    }
    if layout == "moonshot":
        raw.update(first_k_dense_replace=1, moe_layer_freq=1, linear_attn_config={
            "kda_layers": [i + 1 for i, t in enumerate(TINY_LAYERS) if t == "kda"],
            "full_attn_layers": [i + 1 for i, t in enumerate(TINY_LAYERS) if t == "mla"],
            "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4})
    else:
        raw.update(linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
                   layer_types=["linear_attention" if t == "kda" else "full_attention" for t in TINY_LAYERS],
                   mlp_layer_types=["dense"] + ["sparse"] * (len(TINY_LAYERS) - 1))
    return raw


def make_tiny(out: str | Path, seed: int = 0, layout: str = "moonshot") -> Path:
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; pass a new folder")
    ids = train_tiny_tokenizer(out, TINY_VOCAB)
    raw = tiny_raw_config(ids, layout)
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, torch.float32, "cpu")
    init_dummy_weights(model, seed, std=0.1)  # larger than real inits, so that layers visibly matter
    save_checkpoint(model, cfg, raw, out, layout)
    return out
