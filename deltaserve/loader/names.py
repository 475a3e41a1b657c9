"""Where each deltaserve parameter comes from in a checkpoint, for all three layouts of DESIGN.md section 2.

A parameter has one or more *options* (alternative layouts); an option is a list of *pieces*, each a checkpoint
tensor name and the part of the parameter it fills. The loader takes, per parameter, the option whose tensors are
present; the layouts are told apart by name alone:

- Moonshot's published layout: q/k/v_proj, q/k/v_conv1d, f_a/f_b/dt_bias/A_log on self_attn,
  block_sparse_moe.experts.N.{w1,w2,w3}, dense layers under mlp.
- what transformers' save_pretrained writes: the same, except dense layers under block_sparse_moe.
- transformers' in-memory names: conv1d, forget_gate.*, mlp.experts.{gate_up_proj,down_proj}, mlp.gate.*."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.config import KDA, MOE, ModelConfig

FLOAT32_PARAMS = ("A_log", "dt_bias", "gate_weight", "e_score_correction_bias")  # stay f32 whatever the dtype


@dataclass(frozen=True)
class Piece:
    name: str  # checkpoint tensor name
    index: tuple  # where in the parameter it goes: () for all of it, else slices / ints
    shape: tuple[int, ...]  # the checkpoint tensor's expected shape (size-1 dims may differ)


Option = list[Piece]
MLP_PREFIXES = ("mlp", "block_sparse_moe")


def checkpoint_options(cfg: ModelConfig) -> dict[str, list[Option]]:
    """deltaserve parameter name -> its options, for every parameter of KimiLinearForCausalLM(cfg)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    options = {
        "embed_tokens.weight": [[Piece("model.embed_tokens.weight", (), (V, D))]],
        "norm.weight": [[Piece("model.norm.weight", (), (D,))]],
    }
    if not cfg.tie_word_embeddings:
        options["lm_head.weight"] = [[Piece("lm_head.weight", (), (V, D))]]
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            options[f"{dst}{norm}.weight"] = [[Piece(f"{src}{norm}.weight", (), (D,))]]
        attn_options = _kda_options if cfg.layer_types[i] == KDA else _mla_options
        attn = attn_options(cfg, src + "self_attn.")
        mlp = _moe_options(cfg, src) if cfg.mlp_types[i] == MOE else _dense_options(src, D, cfg.intermediate_size)
        options.update({f"{dst}self_attn.{k}": v for k, v in attn.items()})
        options.update({f"{dst}mlp.{k}": v for k, v in mlp.items()})
    return options


def _whole(name: str, shape: tuple[int, ...]) -> list[Option]:
    return [[Piece(name, (), shape)]]


def _stacked(parts: list[tuple[str, int]], cols: tuple[int, ...]) -> Option:
    """Tensors of the given row counts, stacked along dim 0 in order."""
    pieces, start = [], 0
    for name, rows in parts:
        pieces.append(Piece(name, (slice(start, start + rows),), (rows, *cols)))
        start += rows
    return pieces


def _kda_options(cfg: ModelConfig, p: str) -> dict[str, list[Option]]:
    H, K, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.hidden_size, cfg.conv_kernel_size
    HK = H * K

    def gate_param(name, shape):  # the forget gate's tensors live on self_attn, or on self_attn.forget_gate
        return [[Piece(p + name, (), shape)], [Piece(p + "forget_gate." + name, (), shape)]]

    return {
        # every projection of x, in one matmul: q, k, v (the conv's channel order), f_a, g_a, b
        "in_proj.weight": [_stacked([(p + "q_proj.weight", HK), (p + "k_proj.weight", HK), (p + "v_proj.weight", HK),
                                     (p + gate + "f_a_proj.weight", K), (p + "g_a_proj.weight", K),
                                     (p + "b_proj.weight", H)], (D,)) for gate in ("", "forget_gate.")],
        "conv_weight": [_stacked([(p + f"{c}_conv1d.weight", HK) for c in "qkv"], (1, W)),
                        [Piece(p + "conv1d.weight", (), (3 * HK, 1, W))]],
        # both gate up-projections, in one batched matmul: f_b (on self_attn or its forget_gate), then g_b
        "fg_b_proj.weight": [_stacked([(p + gate + "f_b_proj.weight", HK), (p + "g_b_proj.weight", HK)], (K,))
                             for gate in ("", "forget_gate.")],
        "dt_bias": gate_param("dt_bias", (HK,)),
        "A_log": gate_param("A_log", (1, 1, H, 1)),
        "o_norm_weight": _whole(p + "o_norm.weight", (K,)),
        "o_proj.weight": _whole(p + "o_proj.weight", (D, HK)),
    }


def _mla_options(cfg: ModelConfig, p: str) -> dict[str, list[Option]]:
    H, D, R = cfg.num_attention_heads, cfg.hidden_size, cfg.kv_lora_rank
    return {
        # q and the latent's down-projection, in one matmul
        "in_proj.weight": [_stacked([(p + "q_proj.weight", H * cfg.qk_head_dim),
                                     (p + "kv_a_proj_with_mqa.weight", R + cfg.qk_rope_head_dim)], (D,))],
        "kv_a_norm_weight": _whole(p + "kv_a_layernorm.weight", (R,)),
        "kv_b_proj.weight": _whole(p + "kv_b_proj.weight", (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), R)),
        "o_proj.weight": _whole(p + "o_proj.weight", (D, H * cfg.v_head_dim)),
    }


def _dense_options(layer: str, D: int, inter: int, prefix: str = "") -> dict[str, list[Option]]:
    """A SwiGLU under mlp. or block_sparse_moe. (+ prefix, e.g. 'shared_experts.')."""
    return {
        prefix + "gate_up_proj.weight": [
            _stacked([(f"{layer}{m}.{prefix}gate_proj.weight", inter), (f"{layer}{m}.{prefix}up_proj.weight", inter)],
                     (D,))
            for m in MLP_PREFIXES],
        prefix + "down_proj.weight": [[Piece(f"{layer}{m}.{prefix}down_proj.weight", (), (D, inter))]
                                      for m in MLP_PREFIXES],
    }


def _moe_options(cfg: ModelConfig, layer: str) -> dict[str, list[Option]]:
    E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    options = {
        "gate_weight": [[Piece(f"{layer}{m}.gate.weight", (), (E, D))] for m in MLP_PREFIXES],
        "e_score_correction_bias": [[Piece(f"{layer}{m}.gate.e_score_correction_bias", (), (E,))]
                                    for m in MLP_PREFIXES],
        "w13": [[Piece(f"{layer}mlp.experts.gate_up_proj", (), (E, 2 * I, D))]] + [
            [piece for e in range(E) for piece in (
                Piece(f"{layer}{m}.experts.{e}.w1.weight", (e, slice(0, I)), (I, D)),
                Piece(f"{layer}{m}.experts.{e}.w3.weight", (e, slice(I, 2 * I)), (I, D)))]
            for m in MLP_PREFIXES],
        "w2": [[Piece(f"{layer}mlp.experts.down_proj", (), (E, D, I))]] + [
            [Piece(f"{layer}{m}.experts.{e}.w2.weight", (e,), (D, I)) for e in range(E)] for m in MLP_PREFIXES],
    }
    if cfg.num_shared_experts:
        options.update(_dense_options(layer, D, I * cfg.num_shared_experts, prefix="shared_experts."))
    return options
