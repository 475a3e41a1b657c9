"""make-tiny: a small random Kimi-Linear checkpoint with a trained tokenizer, for tests and first runs.

Both kinds of attention, a dense first layer, grouped MoE with a shared expert; random but non-degenerate
(decays, biases, norms and convs all random), so a bug shows in the logits."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from deltaserve.config import ModelConfig
from deltaserve.tokenizer.train import MODEL_MAX_LENGTH, train_tiny_tokenizer

TINY_VOCAB = 512
TINY_LAYERS = "KKMKM"  # K = KDA, M = MLA


def kimi_raw_config(ids, layers: str, *, vocab: int, hidden: int, intermediate: int, moe_intermediate: int,
                    heads: int, kv_lora_rank: int, nope: int, rope: int, v: int, kda_head_dim: int, experts: int = 8,
                    top_k: int = 2, expert_groups: int = 1, layout: str = "moonshot") -> dict:
    """A small Kimi-Linear config.json: `layers` spells the attention of each layer (K = KDA, M = MLA), the first MLP is
    dense; Moonshot's spelling, or the one transformers' save_pretrained writes (layout 'saved' and 'transformers')."""
    raw = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "torch_dtype": "float32",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
        "moe_intermediate_size": moe_intermediate, "num_hidden_layers": len(layers), "num_attention_heads": heads,
        "num_key_value_heads": heads, "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": ids.bos_token_id, "eos_token_id": ids.eos_token_id, "pad_token_id": ids.pad_token_id,
        "model_max_length": MODEL_MAX_LENGTH, "q_lora_rank": None, "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v, "mla_use_nope": True,
        "num_experts": experts, "num_experts_per_token": top_k, "num_shared_experts": 1, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446, "use_grouped_topk": True,
        "num_expert_group": expert_groups, "topk_group": 1,
    }
    if layout == "moonshot":
        raw.update(first_k_dense_replace=1, moe_layer_freq=1, linear_attn_config={
            "kda_layers": [i + 1 for i, t in enumerate(layers) if t == "K"],
            "full_attn_layers": [i + 1 for i, t in enumerate(layers) if t == "M"],
            "head_dim": kda_head_dim, "num_heads": heads, "short_conv_kernel_size": 4})
    else:
        raw.update(linear_head_dim=kda_head_dim, linear_num_heads=heads, linear_conv_kernel_dim=4,
                   layer_types=["linear_attention" if t == "K" else "full_attention" for t in layers],
                   mlp_layer_types=["dense"] + ["sparse"] * (len(layers) - 1))
    return raw


def tiny_raw_config(ids, layout: str) -> dict:
    """config.json of make-tiny's model: 5 layers, hidden 64, 8 experts in 2 groups, top-2."""
    return kimi_raw_config(ids, TINY_LAYERS, vocab=TINY_VOCAB, hidden=64, intermediate=160, moe_intermediate=32,
                           heads=4, kv_lora_rank=32, nope=16, rope=8, v=16, kda_head_dim=16, expert_groups=2,
                           layout=layout)


def make_tiny(out: str | Path, seed: int = 0, layout: str = "moonshot") -> Path:
    """Write the model into a new folder beside `out`, renamed to `out` once complete: a failure leaves nothing."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not empty (or not a folder); pass a new folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create {out.parent} ({e.strerror}); pass a folder in a writable place") from None
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        _write_tiny(staging, seed, layout)
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _write_tiny(folder: Path, seed: int, layout: str) -> None:
    import torch  # here, not above: make-tiny refuses a bad folder before torch's import (a second or two)

    from deltaserve.loader.model_loader import build_model, init_dummy_weights
    from deltaserve.loader.writer import save_checkpoint

    ids = train_tiny_tokenizer(folder, TINY_VOCAB)
    raw = tiny_raw_config(ids, layout)
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, torch.float32, "cpu")
    init_dummy_weights(model, seed, std=0.1)  # larger than real inits, so that layers visibly matter
    save_checkpoint(model, cfg, raw, folder, layout)
