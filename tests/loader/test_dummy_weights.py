"""--load-format dummy: the real 48B shape builds on the meta device with the reference's parameter count, and
small dummy models are random where a bug would otherwise hide."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers.checkpoints import CONFIG_48B, SMALL_RAW_CONFIG

from deltaserve import LLM, SamplingParams
from deltaserve.config import ModelConfig
from deltaserve.loader.model_loader import build_model, init_dummy_weights

TRANSFORMERS_COUNT_48B = 49_122_681_728  # parameters + the router's e_score_correction_bias buffers


@pytest.fixture(scope="module")
def model_48b():
    return build_model(ModelConfig.from_file(CONFIG_48B), torch.bfloat16, "meta")


def expected_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) summed layer by layer from the config, independently of the model code."""
    D, H, K, W = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
    HK, R = H * K, cfg.kv_lora_rank
    kda = 3 * D * HK + 3 * HK * W + 2 * D * K + 2 * K * HK + HK + H + D * H + K + HK * D
    Hm = cfg.num_attention_heads
    mla = (D * Hm * cfg.qk_head_dim + D * (R + cfg.qk_rope_head_dim) + R
           + R * Hm * (cfg.qk_nope_head_dim + cfg.v_head_dim) + Hm * cfg.v_head_dim * D)
    expert = 3 * D * cfg.moe_intermediate_size
    router_and_shared = cfg.num_experts * D + cfg.num_experts + cfg.num_shared_experts * expert
    total = active = 2 * cfg.vocab_size * D + D
    for kind, mlp in zip(cfg.layer_types, cfg.mlp_types):
        common = 2 * D + (kda if kind == "kda" else mla)
        if mlp == "dense":
            total += common + 3 * D * cfg.intermediate_size
            active += common + 3 * D * cfg.intermediate_size
        else:
            total += common + router_and_shared + cfg.num_experts * expert
            active += common + router_and_shared + cfg.num_experts_per_token * expert
    return total, active


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_48b_builds_on_the_meta_device(model_48b):
    assert all(p.is_meta for p in model_48b.parameters()), "the 48B shape must not allocate memory"
    cfg = model_48b.cfg
    assert (cfg.layer_types.count("kda"), cfg.layer_types.count("mla")) == (20, 7)
    assert cfg.mlp_types == ("dense",) + ("moe",) * 26


def test_48b_parameter_counts(model_48b):
    total, active = expected_counts(model_48b.cfg)
    assert num_parameters(model_48b) == total == TRANSFORMERS_COUNT_48B
    assert round(total / 1e9, 1) == 49.1
    assert 3.4e9 < active < 3.6e9  # ~3.5B incl. the 0.75B of embeddings and lm_head: "about 3B active"


def test_48b_count_matches_the_reference_model():
    pytest.importorskip("transformers", minversion="5.23")
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    raw = json.loads(CONFIG_48B.read_text())
    with torch.device("meta"):
        ref = KimiLinearForCausalLM(KimiLinearConfig(
            **{k: v for k, v in raw.items() if k not in ("architectures", "model_type", "torch_dtype")}))
    buffers = sum(b.numel() for name, b in ref.named_buffers() if name.endswith("e_score_correction_bias"))
    assert ref.num_parameters() + buffers == TRANSFORMERS_COUNT_48B


def test_small_config_counts_match_the_formula():
    cfg = ModelConfig.from_dict(SMALL_RAW_CONFIG)
    model = build_model(cfg, torch.float32, "meta")
    assert num_parameters(model) == expected_counts(cfg)[0]


def test_dummy_weights_are_not_degenerate():
    cfg = ModelConfig.from_dict(SMALL_RAW_CONFIG)
    model = build_model(cfg, torch.float32, "cpu")
    init_dummy_weights(model, seed=0)
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert torch.isfinite(p).all() and p.std() > 0, f"{name} is constant"
    a = params["layers.0.self_attn.A_log"].exp()
    assert ((a >= 1) & (a <= 16)).all()
    dt = F.softplus(params["layers.0.self_attn.dt_bias"])
    assert ((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001)).all()
    router = params["layers.1.mlp.gate_weight"]
    assert router.std() >= 0.05, "router weights far from ties"
    assert router.dtype == torch.float32 and torch.equal(router.bfloat16().float(), router), \
        "router weights are values a bfloat16 checkpoint holds (the GPU's router GEMM runs in bf16 on them)"
    assert not torch.allclose(params["layers.0.input_layernorm.weight"], torch.ones(cfg.hidden_size))
    assert params["layers.1.mlp.e_score_correction_bias"].abs().min() > 0


def test_dummy_weights_follow_the_seed():
    cfg = ModelConfig.from_dict(SMALL_RAW_CONFIG)
    a, b, c = (build_model(cfg, torch.float32, "cpu") for _ in range(3))
    init_dummy_weights(a, seed=1)
    init_dummy_weights(b, seed=1)
    init_dummy_weights(c, seed=2)
    for (name, x), (_, y), (_, z) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(x, y) and not torch.equal(x, z), name


def test_dummy_load_format_generates_from_a_folder_with_only_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMALL_RAW_CONFIG))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runs = [LLM(str(tmp_path), device="cpu", load_format="dummy", max_model_len=64, threads=1)
            .generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0] for _ in range(2)]
    assert len(runs[0].outputs[0].token_ids) == 6
    assert runs[0].outputs[0].token_ids == runs[1].outputs[0].token_ids
    assert runs[0].outputs[0].text == ""  # no tokenizer: token ids in, token ids out
