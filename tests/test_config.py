"""ModelConfig: the real 48B config.json and transformers-written configs parse; every unsupported or malformed
value is a ConfigError naming its field. EngineConfig: every bad option is a ConfigError naming the option."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from helpers.checkpoints import CONFIG_48B

from deltaserve.config import ConfigError, EngineConfig, ModelConfig

SHARED_48B = Path(__file__).resolve().parents[2] / "shared" / "models" / "kimi-linear-48b-a3b" / "config.json"
RAW_48B = json.loads(CONFIG_48B.read_text())
KDA_LAYERS_48B = RAW_48B["linear_attn_config"]["kda_layers"]


def raw_48b(**changes) -> dict:
    raw = copy.deepcopy(RAW_48B)
    raw.update(changes)
    return raw


def with_linear(**changes) -> dict:
    raw = raw_48b()
    raw["linear_attn_config"].update(changes)
    return raw


def rejected(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(raw)
    return str(info.value)


def test_test_copy_of_the_48b_config_is_the_shared_one():
    if not SHARED_48B.is_file():
        pytest.skip("../shared is not beside this checkout")
    assert json.loads(SHARED_48B.read_text()) == RAW_48B


def test_48b_config_parses():
    cfg = ModelConfig.from_file(CONFIG_48B)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (163840, 2304, 27)
    assert [i + 1 for i, t in enumerate(cfg.layer_types) if t == "mla"] == [4, 8, 12, 16, 20, 24, 27]  # 1-based
    assert [i + 1 for i in cfg.kda_layer_ids] == KDA_LAYERS_48B
    assert cfg.mlp_types == ("dense",) + ("moe",) * 26
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size) == (32, 128, 4)
    assert (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (32, 128, 64, 128)
    assert (cfg.kv_lora_rank, cfg.qk_head_dim, cfg.latent_dim) == (512, 192, 576)
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.num_shared_experts) == (256, 8, 1)
    assert (cfg.num_expert_group, cfg.topk_group, cfg.moe_renormalize, cfg.routed_scaling_factor) == (1, 1, True, 2.446)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (163584, (163586,), 163839)
    assert cfg.max_position_embeddings == 1048576 and cfg.rms_norm_eps == 1e-5 and cfg.kv_a_layernorm_eps == 1e-6


def test_unused_head_settings_are_ignored():
    """num_key_value_heads, the top-level head_dim and rope settings mean nothing to the NoPE model: values
    that would be invalid for the MLA heads still parse to the same config."""
    noisy = raw_48b(num_key_value_heads=7, head_dim=72, rope_theta=50000.0, qk_head_dim=5,
                    rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096})
    assert ModelConfig.from_dict(noisy) == ModelConfig.from_dict(raw_48b())


def test_eos_token_id_list():
    assert ModelConfig.from_dict(raw_48b(eos_token_id=[163586, 163585])).eos_token_ids == (163586, 163585)


def test_transformers_config_of_the_48b_model_parses_the_same():
    """KimiLinearConfig.to_dict() carries layer_types / mlp_layer_types / linear_* next to the original fields."""
    pytest.importorskip("transformers", minversion="5.23")
    from transformers import KimiLinearConfig

    written = KimiLinearConfig(**{k: v for k, v in RAW_48B.items() if k not in ("architectures", "torch_dtype",
                                                                               "model_type")}).to_dict()
    assert ModelConfig.from_dict(written) == ModelConfig.from_dict(RAW_48B)
    without_originals = {k: v for k, v in written.items() if k not in ("linear_attn_config", "first_k_dense_replace",
                                                                       "moe_layer_freq")}
    assert ModelConfig.from_dict(without_originals) == ModelConfig.from_dict(RAW_48B)


def test_transformers_written_config_json_parses(tmp_path):
    """What save_pretrained writes for a small model: transformers' names only (num_local_experts aliases
    written as num_experts, n_group as num_expert_group, layer_types, mlp_layer_types, linear_*)."""
    pytest.importorskip("transformers", minversion="5.23")
    from transformers import KimiLinearConfig

    config = KimiLinearConfig(
        vocab_size=300, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=6, num_local_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
        norm_topk_prob=False, linear_num_heads=2, linear_head_dim=24, linear_conv_kernel_dim=3,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["sparse", "dense", "sparse", "dense"], eos_token_id=[2, 3])
    config.save_pretrained(tmp_path)
    cfg = ModelConfig.from_file(tmp_path)
    assert cfg.layer_types == ("mla", "kda", "kda", "mla")
    assert cfg.mlp_types == ("moe", "dense", "moe", "dense")
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size) == (2, 24, 3)
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.num_expert_group, cfg.topk_group) == (8, 3, 4, 2)
    assert (cfg.num_shared_experts, cfg.moe_renormalize, cfg.eos_token_ids) == (2, False, (2, 3))


@pytest.mark.parametrize("num_layers,first_dense", [(9, 1), (5, 2), (1, 0)])
def test_mlp_defaults_follow_transformers(num_layers, first_dense):
    """Without mlp_layer_types, the first first_k_dense_replace layers are dense, as in transformers."""
    pytest.importorskip("transformers", minversion="5.23")
    from transformers import KimiLinearConfig

    ref = KimiLinearConfig(num_hidden_layers=num_layers, first_k_dense_replace=first_dense)
    raw = raw_48b(num_hidden_layers=num_layers, first_k_dense_replace=first_dense,
                  linear_attn_config=dict(RAW_48B["linear_attn_config"], kda_layers=list(range(1, num_layers + 1)),
                                          full_attn_layers=[]))
    cfg = ModelConfig.from_dict(raw)
    assert [{"dense": "dense", "moe": "sparse"}[t] for t in cfg.mlp_types] == ref.mlp_layer_types


@pytest.mark.parametrize("removed,field", [
    (("linear_attn_config",), "linear_attn_config.kda_layers"),
    (("kda_layers", "full_attn_layers"), "linear_attn_config.kda_layers"),
    (("num_heads",), "linear_attn_config.num_heads"),
    (("head_dim",), "linear_attn_config.head_dim"),
])
def test_missing_kda_fields_are_named_not_defaulted(removed, field):
    """transformers' defaults (32 heads of 128, full attention every 4th layer) are not guessed: the error names
    the missing field instead of a missing tensor later."""
    raw = raw_48b()
    for name in removed:
        (raw if name == "linear_attn_config" else raw["linear_attn_config"]).pop(name)
    message = rejected(raw)
    assert f"'{field}'" in message and "is required" in message and "copy linear_attn_config" in message


def test_kda_sizes_are_not_required_without_kda_layers():
    lin = {"kda_layers": [], "full_attn_layers": list(range(1, 28))}
    assert ModelConfig.from_dict(raw_48b(linear_attn_config=lin)).kda_layer_ids == []


@pytest.mark.parametrize("field,value", [("kda_layers", 3), ("full_attn_layers", None), ("kda_layers", "1,2"),
                                         ("kda_layers", [True, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21,
                                                         22, 23, 25, 26])])
def test_layer_lists_of_the_wrong_type_name_their_field(field, value):
    message = rejected(with_linear(**{field: value}))
    assert f"'linear_attn_config.{field}' = {value!r}" in message


@pytest.mark.parametrize("field,value", [("moe_renormalize", "false"), ("tie_word_embeddings", "false"),
                                         ("moe_renormalize", 0), ("tie_word_embeddings", 1)])
def test_booleans_must_be_json_booleans(field, value):
    message = rejected(raw_48b(**{field: value}))
    assert f"'{field}' = {value!r}" in message and "true or false" in message


def test_infinity_in_config_json_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(raw_48b(rms_norm_eps=float("inf"))))  # writes Infinity
    with pytest.raises(ConfigError, match=r"'rms_norm_eps' = inf: must be a positive number, finite"):
        ModelConfig.from_file(tmp_path)


def test_norm_topk_prob_false_is_read():
    raw = raw_48b(norm_topk_prob=False)
    del raw["moe_renormalize"]
    assert ModelConfig.from_dict(raw).moe_renormalize is False


@pytest.mark.parametrize("field,value", [("eos_token_id", True), ("eos_token_id", [163586, False]),
                                         ("bos_token_id", "163584"), ("pad_token_id", True)])
def test_token_ids_must_be_integers_not_bools(field, value):
    assert f"'{field}'" in rejected(raw_48b(**{field: value}))


@pytest.mark.parametrize("field", ["model_max_length", "max_position_embeddings"])
def test_model_length_of_one_names_the_field(field):
    raw = raw_48b(**{field: 1})
    raw.pop("model_max_length" if field == "max_position_embeddings" else "max_position_embeddings", None)
    message = rejected(raw)
    assert f"'{field}' = 1" in message and ">= 2" in message


@pytest.mark.parametrize("field,value,expectation", [
    ("model_type", "deepseek_v3", "only 'kimi_linear'"),
    ("model_type", None, "only 'kimi_linear'"),
    ("mla_use_nope", False, "NoPE"),
    ("hidden_act", "gelu", "silu"),
    ("q_lora_rank", 1536, "must be null"),
    ("moe_router_activation_func", "softmax", "sigmoid"),
    ("attention_bias", True, "must be false"),
    ("num_nextn_predict_layers", 1, "not supported"),
])
def test_unsupported_values_name_their_field(field, value, expectation):
    message = rejected(raw_48b(**{field: value}))
    assert f"'{field}'" in message and repr(value) in message and expectation in message


@pytest.mark.parametrize("field,value", [
    ("hidden_size", 2304.0), ("hidden_size", "2304"), ("hidden_size", True), ("hidden_size", 0),
    ("vocab_size", -5), ("num_hidden_layers", 27.5), ("kv_lora_rank", [512]), ("num_experts", "256"),
    ("num_experts_per_token", 8.0), ("moe_intermediate_size", None), ("v_head_dim", 0),
])
def test_non_integer_sizes_name_their_field(field, value):
    message = rejected(raw_48b(**{field: value}))
    assert f"'{field}'" in message
    assert ("must be an integer" in message) or ("is required" in message)


def test_missing_required_field():
    raw = raw_48b()
    del raw["vocab_size"]
    assert "'vocab_size'" in rejected(raw) and "is required" in rejected(raw)


@pytest.mark.parametrize("field,value", [("num_heads", "32"), ("head_dim", 0), ("short_conv_kernel_size", 1)])
def test_bad_linear_attn_config_values(field, value):
    assert f"'linear_attn_config.{field}'" in rejected(with_linear(**{field: value}))


def test_linear_attn_config_must_be_an_object():
    assert "'linear_attn_config'" in rejected(raw_48b(linear_attn_config=[1, 2]))


@pytest.mark.parametrize("field,value", [("rms_norm_eps", -1e-5), ("rms_norm_eps", "1e-5"),
                                         ("routed_scaling_factor", 0), ("rms_norm_eps", float("inf")),
                                         ("routed_scaling_factor", float("inf")), ("rms_norm_eps", float("nan"))])
def test_bad_numbers(field, value):
    message = rejected(raw_48b(**{field: value}))
    assert f"'{field}'" in message and "positive number" in message


@pytest.mark.parametrize("changes,field", [
    (dict(kda_layers=[0] + KDA_LAYERS_48B[1:]), "linear_attn_config.kda_layers"),  # 1-based: 0 is out of range
    (dict(full_attn_layers=[4, 8, 12, 16, 20, 24, 28]), "linear_attn_config.full_attn_layers"),
    (dict(full_attn_layers=[4, 8, 12, 16, 20, 24, 27, "3"]), "linear_attn_config.full_attn_layers"),
])
def test_layer_lists_out_of_range(changes, field):
    message = rejected(with_linear(**changes))
    assert f"'{field}'" in message and "1-based" in message


@pytest.mark.parametrize("changes", [
    dict(full_attn_layers=[1, 4, 8, 12, 16, 20, 24, 27]),  # layer 1 in both lists
    dict(kda_layers=KDA_LAYERS_48B + [2]),  # layer 2 twice in one list
])
def test_duplicated_layers(changes):
    message = rejected(with_linear(**changes))
    assert "linear_attn_config." in message and "listed twice" in message


def test_layers_in_neither_list():
    message = rejected(with_linear(full_attn_layers=[4, 8, 12, 16, 20, 24]))
    assert "'linear_attn_config'" in message and "[27]" in message and "neither" in message


@pytest.mark.parametrize("field,value", [
    ("layer_types", ["linear_attention"] * 26),  # one short
    ("layer_types", ["linear_attention"] * 26 + ["sliding_attention"]),
    ("mlp_layer_types", ["dense"] + ["moe"] * 26),  # transformers spells it 'sparse'
    ("mlp_layer_types", "dense"),
])
def test_bad_transformers_layer_lists(field, value):
    raw = raw_48b(**{field: value})
    if field == "layer_types":
        del raw["linear_attn_config"]
    message = rejected(raw)
    assert f"'{field}'" in message and "must list 27" in message


@pytest.mark.parametrize("changes,field,expectation", [
    (dict(num_expert_group=3), "num_expert_group", "must divide num_experts (256)"),
    (dict(num_expert_group=256, topk_group=1), "num_expert_group", "1 expert per group"),
    (dict(num_expert_group=8, topk_group=9), "topk_group", "must be in [1, num_expert_group=8]"),
    (dict(num_expert_group=8, topk_group=0), "topk_group", "must be an integer >= 1"),
    (dict(num_expert_group=8, topk_group=1, num_experts_per_token=33), "num_experts_per_token", "<= topk_group"),
    (dict(eos_token_id=163840), "eos_token_id", "vocab_size=163840"),
])
def test_router_and_token_rules(changes, field, expectation):
    message = rejected(raw_48b(**changes))
    assert f"'{field}'" in message and expectation in message


def test_invalid_json_file(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "kimi_linear",')
    with pytest.raises(ConfigError, match="not valid JSON") as info:
        ModelConfig.from_file(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_json_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ConfigError, match="must hold a JSON object, got list"):
        ModelConfig.from_file(tmp_path)


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json") as info:
        ModelConfig.from_file(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_engine_config_defaults_are_valid():
    engine = EngineConfig()
    assert (engine.dtype, engine.device, engine.load_format) == ("float32", "cpu", "auto")


@pytest.mark.parametrize("option,value", [
    ("max_num_seqs", 0), ("max_num_seqs", 2.5), ("max_num_batched_tokens", -1), ("block_size", 0),
    ("block_size", 2048), ("max_model_len", 0), ("max_model_len", "4k"), ("dtype", "float64"), ("device", "tpu"),
    ("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5), ("load_format", "pt"), ("threads", 0),
    ("num_cache_blocks", 0), ("num_decode_steps", 0), ("num_decode_steps", 65), ("num_decode_steps", 2.0),
    ("async_scheduling", "yes"), ("async_scheduling", 1),
    # types a caller of LLM(...) may pass: each refused here, not deep in the load or a step
    ("max_num_seqs", True), ("threads", True), ("num_cache_blocks", "10"), ("num_cache_blocks", 2.5),
    ("cache_bytes", "1GB"), ("cache_bytes", 0), ("gpu_memory_utilization", "x"), ("gpu_memory_utilization", None),
    ("device", 0), ("enable_prefix_caching", "no"), ("cpu_gemv", "no"), ("pdl", 3), ("seed", "x"), ("seed", 2**70),
])
def test_engine_config_rejections_name_the_option(option, value):
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{option: value})
    assert f"engine option {option} = {value!r}" in str(info.value)


def test_async_scheduling_error_says_what_it_takes():
    with pytest.raises(ConfigError, match=r"async_scheduling = 'on': must be True, False or None \(on for a GPU\)"):
        EngineConfig(async_scheduling="on")


@pytest.mark.parametrize("value", [0, 65])
def test_num_decode_steps_error_says_the_range(value):
    with pytest.raises(ConfigError, match=r"num_decode_steps = .*: must be an integer in \[1, 64\]"):
        EngineConfig(num_decode_steps=value)


def test_compile_decode_is_a_bool_and_for_the_cpu():
    assert EngineConfig(compile_decode=True).compile_decode
    with pytest.raises(ConfigError, match=r"compile_decode = 'yes': must be True or False"):
        EngineConfig(compile_decode="yes")
    with pytest.raises(ConfigError, match=r"compile_decode = True: is for the CPU \(on a GPU, decode steps replay"):
        EngineConfig(compile_decode=True, device="cuda")
    with pytest.raises(ConfigError, match=r"compile_decode = True: runs one process's whole forward"):
        EngineConfig(compile_decode=True, tensor_parallel_size=2)


def test_a_tokenizer_json_passed_for_the_model_folder(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"vocab": {}}}))
    with pytest.raises(ConfigError, match=r"tokenizer.json is not a model's config.json \(it has no model_type\): "
                                          r"pass the model folder"):
        ModelConfig.from_file(tmp_path / "tokenizer.json")


def test_a_config_file_of_another_name_parses(tmp_path):
    """bench --config FILE --load-format dummy takes any file name."""
    (tmp_path / "48b.json").write_text(json.dumps(RAW_48B))
    assert ModelConfig.from_file(tmp_path / "48b.json") == ModelConfig.from_dict(RAW_48B)
