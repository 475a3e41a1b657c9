"""Small random Kimi-Linear models built with the reference (transformers), written in the three checkpoint layouts.

The reference initialises routers and norms so mildly (router std 0.02, zero correction bias, unit norms) that a
bug in them could hide; `build_reference` re-initialises those to values where every part visibly matters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

pytest.importorskip("transformers", minversion="5.23")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

LAYOUTS = ("saved", "moonshot", "transformers")
KDA_T, MLA_T = "linear_attention", "full_attention"

# Configs that vary every dimension the engine reads. Each name says what it stresses.
SPECS: dict[str, dict] = {
    "hybrid": dict(  # KDA and MLA alternating, dense first layer, two expert groups
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_local_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=[KDA_T, MLA_T, KDA_T, MLA_T], mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
    "mla_first_dense_middle": dict(  # MLA first, a dense layer in the middle, wide v, 2 shared experts, no renorm
        hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_attention_heads=2, kv_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_local_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.5,
        linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=2,
        layer_types=[MLA_T, KDA_T, KDA_T], mlp_layer_types=["sparse", "dense", "sparse"]),
    "kda_only": dict(  # no MLA layer at all, one KDA head of 32, conv kernel 3, top-1 routing
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=2, kv_lora_rank=8,
        qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, num_local_experts=6, num_experts_per_tok=1, n_group=1,
        topk_group=1, linear_num_heads=1, linear_head_dim=32, linear_conv_kernel_dim=3, rms_norm_eps=1e-6,
        layer_types=[KDA_T, KDA_T, KDA_T], mlp_layer_types=["dense", "sparse", "sparse"]),
    "mla_only": dict(  # no KDA layer at all, 3 heads, odd dims, every layer MoE
        hidden_size=40, intermediate_size=56, moe_intermediate_size=20, num_attention_heads=3, kv_lora_rank=12,
        qk_nope_head_dim=6, qk_rope_head_dim=2, v_head_dim=10, num_local_experts=12, num_experts_per_tok=3,
        n_group=3, topk_group=2, linear_num_heads=2, linear_head_dim=8,
        layer_types=[MLA_T, MLA_T], mlp_layer_types=["sparse", "sparse"]),
    "deep": dict(  # six layers in the 48B model's pattern of 3 KDA then 1 MLA, 32 experts in 8 groups, top-8
        hidden_size=64, intermediate_size=128, moe_intermediate_size=16, num_attention_heads=4, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_local_experts=32, num_experts_per_tok=8,
        n_group=8, topk_group=4, linear_num_heads=4, linear_head_dim=24, linear_conv_kernel_dim=4,
        layer_types=[KDA_T, KDA_T, KDA_T, MLA_T, KDA_T, MLA_T],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse", "sparse"]),
}


def reference_config(vocab_size: int = 256, **spec) -> KimiLinearConfig:
    spec = dict(spec)
    spec.setdefault("num_key_value_heads", spec.get("num_attention_heads", 4))
    return KimiLinearConfig(vocab_size=vocab_size, num_hidden_layers=len(spec["layer_types"]), pad_token_id=0,
                            bos_token_id=1, eos_token_id=2, initializer_range=0.1, **spec)


@torch.no_grad()
def build_reference(spec: dict, seed: int) -> KimiLinearForCausalLM:
    """The reference model of `spec`, random and non-degenerate: routers of std 0.2, a random correction bias,
    norms around 1, conv taps of std 0.3 (A_log in log[1, 16] and dt_bias come from the reference's own init)."""
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(reference_config(**spec)).eval()
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            param.normal_(0.0, 0.2)
        elif name.endswith("norm.weight"):  # input/post-attention/final, kv_a_layernorm, KDA's gated o_norm
            param.normal_(1.0, 0.2)
        elif name.endswith("conv1d.weight"):
            param.normal_(0.0, 0.3)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.1)
    return model


def save_layouts(model: KimiLinearForCausalLM, root: Path) -> dict[str, Path]:
    """Write the model as (1) what save_pretrained writes, (2) Moonshot's published layout and config spelling,
    (3) transformers' in-memory tensor names. Returns layout -> folder."""
    folders = {layout: Path(root) / layout for layout in LAYOUTS}
    model.save_pretrained(folders["saved"])
    saved_config = json.loads((folders["saved"] / "config.json").read_text())

    folders["moonshot"].mkdir(parents=True)
    with safe_open(str(folders["saved"] / "model.safetensors"), framework="pt") as f:
        tensors = {_moonshot_name(name): f.get_tensor(name) for name in f.keys()}
    save_file(tensors, str(folders["moonshot"] / "model.safetensors"), metadata={"format": "pt"})
    _write_json(folders["moonshot"] / "config.json", moonshot_config(saved_config))

    folders["transformers"].mkdir(parents=True)
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(folders["transformers"] / "model.safetensors"), metadata={"format": "pt"})
    _write_json(folders["transformers"] / "config.json", saved_config)
    return folders


def _moonshot_name(name: str) -> str:
    """save_pretrained writes a dense layer's MLP under block_sparse_moe.; the published checkpoint under mlp."""
    return re.sub(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.", r".mlp.\1.", name)


def moonshot_config(saved: dict) -> dict:
    """A transformers-written config.json respelled the way Moonshot's published config.json spells it."""
    transformers_only = ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim",
                         "linear_conv_kernel_dim")
    raw = {k: v for k, v in saved.items() if k not in transformers_only}
    layers, mlps = saved["layer_types"], saved["mlp_layer_types"]
    raw["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, t in enumerate(layers) if t == KDA_T],
        "full_attn_layers": [i + 1 for i, t in enumerate(layers) if t == MLA_T],
        "num_heads": saved["linear_num_heads"], "head_dim": saved["linear_head_dim"],
        "short_conv_kernel_size": saved["linear_conv_kernel_dim"],
    }
    num_dense = mlps.index("sparse") if "sparse" in mlps else len(mlps)
    if mlps == ["dense"] * num_dense + ["sparse"] * (len(mlps) - num_dense):
        raw.update(first_k_dense_replace=num_dense, moe_layer_freq=1)
    else:  # not expressible as first_k_dense_replace: keep the per-layer list
        raw["mlp_layer_types"] = mlps
    raw.update(mla_use_nope=True, moe_router_activation_func="sigmoid", use_grouped_topk=True,
               num_nextn_predict_layers=0)
    return raw


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


@torch.no_grad()
def reference_logits(model: KimiLinearForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """One forward pass over the whole sequence: logits [T, V] float32."""
    return model(torch.tensor([token_ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def reference_greedy(model: KimiLinearForCausalLM, prompt: list[int], num_tokens: int) -> list[int]:
    """The reference's greedy continuation (its own prefill + cached decode); EOS is a token like any other.

    The reference's cache cannot serve a model without any full-attention layer, so for those every token is
    the argmax of a full forward pass over the sequence so far.
    """
    if MLA_T not in model.config.layer_types:
        ids = list(prompt)
        for _ in range(num_tokens):
            ids.append(int(reference_logits(model, ids)[-1].argmax()))
        return ids[len(prompt):]
    ids = torch.tensor([prompt])
    # eos_token_id=None rather than min_new_tokens, which would mask EOS out of the argmax instead of ignoring it
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=num_tokens,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert len(out) == num_tokens
    return out
